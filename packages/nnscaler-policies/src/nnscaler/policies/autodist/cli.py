"""``nnscaler plan``: inspect autodist plans (a plug-in of nnscaler-cli, entry point ``plan`` in
the group ``nnscaler.commands``; needs the ``cli`` extra: typer and rich).

``nnscaler plan show PLAN.json`` prints, per module, the partition autodist chose (op:choice
counts), the estimated memory and time and the pipeline stage, then the totals of the plan's
estimate. Exit code 0 on success, 1 with a one-line error on a missing, unreadable or malformed
plan file.

``nnscaler plan estimate`` plans a described cluster without its GPUs (`nnscaler.policies.estimate.cli`).
"""
from __future__ import annotations

import math
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from ..estimate.cli import estimate

app = typer.Typer(help="autodist plans: show what a saved plan (pas_config['save_plan_path']) chose; estimate a plan "
                        "for a described cluster.",
                  no_args_is_help=True, add_completion=False)
_err = Console(stderr=True)
app.command("estimate")(estimate)


def _fail(message: str) -> None:
    _err.print(f"[red]Error:[/red] {message}", markup=True, highlight=False, soft_wrap=True)
    raise typer.Exit(1)


def _mb(nbytes) -> str:
    return f"{float(nbytes) / 2 ** 20:,.2f}"


def _ms(seconds) -> str:
    return f"{float(seconds) * 1e3:,.3f}"


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_record(record) -> None:
    """The fields `show` reads have the types it needs (from_json checks their presence, and the pipeline)."""
    if not isinstance(record.ops, list) or not isinstance(record.estimate, dict):
        raise ValueError("'ops' must be a list and 'estimate' a mapping")
    for i, op in enumerate(record.ops):
        if not (isinstance(op.key, str) and isinstance(op.op, str) and isinstance(op.choice, str)):
            raise ValueError(f"op {i}: key, op and choice must be strings")
        if not (_number(op.time_s) and _number(op.mem_bytes)):
            raise ValueError(f"op {i} ({op.key}): time_s and mem_bytes must be numbers")
        if op.stage is not None and (isinstance(op.stage, bool) or not isinstance(op.stage, int)):
            raise ValueError(f"op {i} ({op.key}): stage must be an integer or null")
    for key, value in record.estimate.items():
        if key.endswith(("_s", "_bytes")) and not _number(value):
            raise ValueError(f"estimate {key!r} must be a number, got {value!r}")


def _load(plan: Path):
    from .plan_file import StalePlanError, read_plan
    try:
        record = read_plan(plan)
    except StalePlanError as e:
        _fail(str(e))
    try:
        _check_record(record)
    except ValueError as e:
        _fail(f"{plan} is a damaged autodist plan ({e}); save it again with pas_config['save_plan_path']")
    return record


@app.command()
def show(plan: Path = typer.Argument(..., help="A plan JSON written by pas_config['save_plan_path']."),
         depth: int = typer.Option(3, "--depth", min=1,
                                   help="Group ops by the first DEPTH parts of their module path "
                                        "(1: h, 2: h.0, 3: h.0.attn).")) -> None:
    """Per module: partition (op:choice counts), estimated memory and time, stage; then totals."""
    from .report import module_rows
    record = _load(plan)
    rows = module_rows(record, depth)
    console = Console()
    console.print(f"[bold]{plan}[/bold]: autodist plan for {record.module_class} on plan_ngpus="
                  f"{record.plan_ngpus} (task {record.task_name}, solver {record.method or '?'}), "
                  f"{len(record.ops)} ops", highlight=False)
    p = record.pipeline
    if p:
        console.print(f"  pipeline: {p['nstages']} stages x {p['tp_size']} devices, {p['nmicros']} micro-batches, "
                      f"{p['scheduler']} schedule", highlight=False)
    table = Table("module", "partition (op:choice)", "memory MB", "time ms", "stage")
    for col in (2, 3):
        table.columns[col].justify = "right"
    for module, partition, mem, seconds, stages in rows:
        table.add_row(module, partition, _mb(mem), _ms(seconds), stages)
    table.add_section()
    table.add_row(f"{len(rows)} modules", f"{len(record.ops)} ops",
                  _mb(sum(r[2] for r in rows)), _ms(sum(r[3] for r in rows)), "")
    console.print(table)
    est = record.estimate
    line = (f"  total: estimated step time {_ms(est.get('time_s', 0.0))} ms, memory per device "
            f"{_mb(est.get('mem_bytes', 0.0))} MB (of which transient {_mb(est.get('transient_bytes', 0.0))} MB)")
    if est.get("mem_limit_bytes"):
        line += f", limit {_mb(est['mem_limit_bytes'])} MB"
    console.print(line, highlight=False)
    extra = []
    if "search_s" in est:
        extra.append(f"search {float(est['search_s']):.3f} s")
    if "solver_s" in est:
        extra.append(f"solver {float(est['solver_s']):.3f} s")
    if "profiled_ops" in est or "cached_ops" in est:
        extra.append(f"ops profiled {est.get('profiled_ops', 0)}, from the cache {est.get('cached_ops', 0)}")
    if extra:
        console.print("  " + "; ".join(extra), highlight=False)
