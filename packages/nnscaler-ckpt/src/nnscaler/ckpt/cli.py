"""``nnscaler ckpt``: merge, inspect, verify and convert checkpoints (a plug-in of nnscaler-cli,
entry point ``ckpt`` in the group ``nnscaler.commands``). Exit code 0 on success, 1 on a refused
or bad checkpoint (the message names the file and the fix)."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import typer
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn
from rich.table import Table

app = typer.Typer(help="Checkpoints of nnscaler training: merge, inspect, verify, convert.", no_args_is_help=True,
                  add_completion=False)
_err = Console(stderr=True)


def _run(fn: Callable[[], None]) -> None:
    from .errors import CheckpointError
    try:
        fn()
    except (CheckpointError, ValueError) as e:
        _err.print(f"[red]Error:[/red] {e}", markup=True, highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None


def _with_progress(label: str, work: Callable) -> None:
    with Progress(TextColumn(label), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn(),
                  TextColumn("{task.fields[tensor]}"), console=_err, transient=False) as bar:
        task = bar.add_task(label, total=None, tensor="")

        def progress(done: int, total: int, name: str) -> None:
            bar.update(task, completed=done, total=total, tensor=name)
        work(progress)


@app.command()
def merge(src: Path = typer.Argument(..., help="A sharded or deduped checkpoint directory."),
          dst: Path = typer.Argument(..., help="The merged checkpoint directory to create."),
          max_shard_size: str = typer.Option("5GB", help="Largest model file: 100KB, 64MB, 5GB or bytes."),
          model_only: bool = typer.Option(False, "--model-only", help="Leave out the optimizer and RNG states."),
          overwrite: bool = typer.Option(False, "--overwrite", help="Replace DST if it is an earlier merge output "
                                         "(never a directory holding anything else, SRC or part of it); atomic."),
          hf: bool = typer.Option(False, "--hf", help="Write a directory AutoModelForCausalLM.from_pretrained loads: "
                                  "config.json, the model's own tensor names, the run's tokenizer; no optimizer.")) -> None:
    """Merge a checkpoint into the Hugging Face layout (model.safetensors ...), streaming."""
    from .merge import merge as merge_
    from .replace_guard import check_merge_destination

    def work() -> None:
        check_merge_destination(dst.absolute(), overwrite, [src.absolute()])  # before the progress bar shows
        _with_progress("merging", lambda p: merge_(src, dst, max_shard_size=max_shard_size, model_only=model_only,
                                                   overwrite=overwrite, progress=p, hf=hf))
    _run(work)
    typer.echo(f"merged {src} -> {dst}")


@app.command()
def inspect(src: Path = typer.Argument(..., help="A checkpoint directory.")) -> None:
    """Show a checkpoint's kind, plan, world size and tensors."""
    from .summary import inspect as inspect_

    def show() -> None:
        info = inspect_(src)
        console = Console()
        plan = info["plan"] or []
        console.print(f"[bold]{info['path']}[/bold]: {info['kind']} checkpoint, format {info['format_version']}, "
                      f"world size {info['world_size']}, created {info['created']}", highlight=False)
        for p in plan:
            cfg = p.get("compute_config", {})
            console.print(f"  plan: {p.get('class')} at '{p.get('path')}', graph {p.get('graph_fingerprint')}, "
                          f"plan_ngpus {cfg.get('plan_ngpus')}, runtime_ngpus {cfg.get('runtime_ngpus')}, "
                          f"use_zero {cfg.get('use_zero')}", highlight=False)
        if info["optimizer"]:
            console.print(f"  optimizer: {info['optimizer']} ({', '.join(info['optimizer_states'])})")
        table = Table("tensor", "full shape", "dtype", "pieces", "bytes")
        for t in info["tensors"]:
            table.add_row(t["name"], str(tuple(t["shape"])), t["dtype"], str(t["pieces"]), f"{t['bytes']:,}")
        table.add_section()
        table.add_row(f"{len(info['tensors'])} tensors", f"{info['parameters']:,} elements", "", "",
                      f"{info['model_bytes']:,}")
        console.print(table)
        console.print(f"  {len(info['files'])} files, {info['file_bytes']:,} bytes")
    _run(show)


@app.command()
def verify(src: Path = typer.Argument(..., help="A checkpoint directory.")) -> None:
    """Check every file's size and SHA-256 against the manifest (exit code 1 names the bad file)."""
    from .verify import verify as verify_

    def check() -> None:
        m = verify_(src)
        typer.echo(f"OK: {src} ({m.kind}, {len(m.files)} files verified)")
    _run(check)


@app.command()
def convert(src: Path = typer.Argument(..., help="A torch state_dict file, a .safetensors file or a Hugging Face "
                                                 "model directory."),
            dst: Path = typer.Argument(..., help="The merged checkpoint directory to create."),
            max_shard_size: str = typer.Option("5GB", help="Largest model file: 100KB, 64MB, 5GB or bytes."),
            overwrite: bool = typer.Option(False, "--overwrite", help="Replace DST if it is an earlier merge or "
                                           "convert output (never a directory holding anything else).")) -> None:
    """Convert weights (torch file read with weights_only=True, or Hugging Face) into a merged checkpoint."""
    from .convert import convert as convert_
    _run(lambda: _with_progress("converting", lambda p: convert_(src, dst, max_shard_size=max_shard_size,
                                                                overwrite=overwrite, progress=p)))
    typer.echo(f"converted {src} -> {dst}")
