"""``nnscaler info``: what is installed and what this machine offers.

torch is imported inside the command only, never when this module is imported.
"""
from __future__ import annotations

import json
import os
import platform
import sys
from importlib import metadata
from typing import Any, Optional

import typer


def nnscaler_distributions() -> list[tuple[str, str, str]]:
    """``(name, version, where)`` of each installed distribution named ``nnscaler*``.

    The first one found on ``sys.path`` is the one Python imports; later duplicates are skipped.
    """
    found: dict[str, tuple[str, str, str]] = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"] or ""
        key = name.lower().replace("_", "-")
        if key.startswith("nnscaler") and key not in found:
            found[key] = (name, dist.version, _where(dist))
    return sorted(found.values(), key=lambda row: (row[0] != "nnscaler", row[0]))


def _where(dist: metadata.Distribution) -> str:
    direct_url = dist.read_text("direct_url.json")
    if direct_url:
        info = json.loads(direct_url)
        url = info.get("url", "")
        path = url[len("file://"):] if url.startswith("file://") else url
        if info.get("dir_info", {}).get("editable"):
            return f"editable {path}"
    return str(dist.locate_file(""))


def distributed_backends(torch: Any) -> dict[str, bool]:
    """Which torch.distributed backends this torch build has."""
    dist = torch.distributed
    available = dist.is_available()
    return {
        "gloo": available and dist.is_gloo_available(),
        "nccl": available and dist.is_nccl_available(),
        "mpi": available and dist.is_mpi_available(),
    }


def devices(torch: Any) -> list[tuple[str, str]]:
    """``(device, description)`` rows: the CPU, then every visible CUDA device."""
    rows = [("cpu", f"{os.cpu_count()} logical cores")]
    if torch.cuda.is_available():
        rows += [(f"cuda:{i}", torch.cuda.get_device_name(i))
                 for i in range(torch.cuda.device_count())]
    elif torch.version.cuda is None:
        rows.append(("cuda", "none: this torch build has no CUDA"))
    else:
        rows.append(("cuda", "none visible"))
    return rows


def _import_torch() -> tuple[Optional[Any], Optional[str]]:
    """``(torch, None)``, or ``(None, why)`` when torch is missing or its import fails (a broken
    install raises anything: OSError for a missing shared library, AttributeError, ...)."""
    try:
        import torch
    except ImportError as e:
        if isinstance(e, ModuleNotFoundError) and e.name == "torch":
            return None, None  # not installed
        return None, _broken(e)
    except Exception as e:  # noqa: BLE001 - reported, not raised: `info` is what diagnoses this
        return None, _broken(e)
    return torch, None


def _broken(e: BaseException) -> str:
    where = ""
    try:
        import importlib.util
        spec = importlib.util.find_spec("torch")
        if spec is not None and spec.origin:
            where = f" (from {os.path.dirname(spec.origin)})"
    except Exception:  # noqa: BLE001
        pass
    message = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {message}{where}"


def _torch_rows(torch: Any) -> list[tuple[str, str]]:
    """The environment rows about torch; a torch that imports but fails here is reported broken."""
    try:
        cuda = torch.version.cuda
        rows = [("torch", torch.__version__ + (f" (CUDA {cuda})" if cuda else ""))]
        backends = distributed_backends(torch)
        rows.append(("distributed backends", ", ".join(
            f"{name} [green]yes[/green]" if ok else f"{name} [dim]no[/dim]" for name, ok in backends.items())))
        rows += devices(torch)
    except Exception as e:  # noqa: BLE001
        return [("torch", _broken_row(_broken(e)))]
    return rows


def _broken_row(why: str) -> str:
    from rich.markup import escape
    return (f"[red]broken[/red]: {escape(why)}; reinstall it (pip install --force-reinstall torch, or "
            f"bash tools/install.sh)")


def info(ctx: typer.Context) -> None:
    """Show the installed nnscaler packages, torch, distributed backends and devices."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    packages = Table(title="nnscaler distributions", title_justify="left")
    for column in ("distribution", "version", "installed at"):
        packages.add_column(column)
    for row in nnscaler_distributions():
        packages.add_row(*row)
    console.print(packages)

    env = Table(title="environment", title_justify="left", show_header=False)
    env.add_column(style="bold")
    env.add_column()
    env.add_row("python", f"{platform.python_version()} ({sys.executable})")
    env.add_row("platform", platform.platform())
    torch, broken = _import_torch()
    if broken is not None:
        env.add_row("torch", _broken_row(broken))
    elif torch is None:
        env.add_row("torch", "[red]not installed[/red] (bash tools/install.sh installs it)")
    else:
        for name, value in _torch_rows(torch):
            env.add_row(name, value)
    console.print(env)

    group = ctx.parent.command if ctx.parent is not None else None
    plugins = group.plugins() if hasattr(group, "plugins") else []
    if plugins:
        from .plugins import load_error

        table = Table(title="plug-in commands (entry points 'nnscaler.commands')",
                      title_justify="left")
        for column in ("command", "target", "distribution", "status"):
            table.add_column(column)
        for plugin in plugins:
            if plugin.shadowed_by:
                status = f"[yellow]hidden by {plugin.shadowed_by}[/yellow]"
            else:
                error = load_error(plugin)
                status = "[green]ok[/green]" if error is None else f"[red]{error}[/red]"
            table.add_row(plugin.name, plugin.entry_point.value, plugin.distribution, status)
        console.print(table)
