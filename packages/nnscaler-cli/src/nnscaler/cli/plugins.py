"""Sub-commands contributed by installed packages through the entry-point group
``nnscaler.commands``.

An entry point names a ``typer.Typer`` (it becomes a group of sub-commands under the entry
point's name) or a plain function (it becomes one command). Entry points are loaded only when
their command is run: the top-level help lists them with their distribution's summary, read
from its metadata without importing anything. A plug-in that fails to load is reported when its
command runs, with the entry point and the distribution to fix, and never breaks
``nnscaler --help`` or the other commands.
"""
from __future__ import annotations

import dataclasses
from importlib import metadata
from typing import Any, Iterable, Optional

import typer
from typer.core import TyperCommand, TyperGroup

from . import ENTRY_POINT_GROUP

PANEL = "Plug-in commands"


@dataclasses.dataclass(frozen=True)
class Plugin:
    """One entry point of the group; ``shadowed_by`` says what hides it, if anything."""

    entry_point: metadata.EntryPoint
    shadowed_by: Optional[str] = None

    @property
    def name(self) -> str:
        return self.entry_point.name

    @property
    def distribution(self) -> str:
        dist = getattr(self.entry_point, "dist", None)
        if dist is None:
            return "an unknown distribution"
        return f"{dist.metadata['Name']} {dist.version}"

    @property
    def summary(self) -> str:
        dist = getattr(self.entry_point, "dist", None)
        summary = dist.metadata["Summary"] if dist is not None else None
        return summary or f"Plug-in command from {self.distribution}."

    @property
    def help_text(self) -> str:
        """The summary, safe to show where help is rendered as rich markup."""
        return self.summary.replace("[", r"\[")

    def describe(self) -> str:
        ep = self.entry_point
        return (f"entry point '{ep.name} = {ep.value}' (group '{ENTRY_POINT_GROUP}') "
                f"of {self.distribution}")


def discover(reserved: Iterable[str] = ()) -> list[Plugin]:
    """Every entry point of the group, in ``sys.path`` order.

    A name in ``reserved`` (the built-in commands) or already taken by an earlier entry point
    is marked shadowed: the first one on ``sys.path`` wins, as imports do.
    """
    reserved = set(reserved)
    owners: dict[str, Plugin] = {}
    found = []
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in reserved:
            plugin = Plugin(ep, shadowed_by="the built-in command")
        elif ep.name in owners:
            plugin = Plugin(ep, shadowed_by=owners[ep.name].describe())
        else:
            plugin = owners[ep.name] = Plugin(ep)
        found.append(plugin)
    return found


def load_command(plugin: Plugin) -> Any:
    """Import the entry point and turn it into a command named after the entry point."""
    obj = plugin.entry_point.load()
    if isinstance(obj, typer.Typer):
        command = typer.main.get_group(obj)
        command.help = command.help or plugin.help_text
        command.no_args_is_help = True  # `nnscaler ckpt` alone shows the group's help
    elif callable(obj):
        single = typer.Typer(add_completion=False)
        single.command(name=plugin.name)(obj)
        command = typer.main.get_command(single)
    else:
        raise TypeError(f"'{plugin.entry_point.value}' is a {type(obj).__name__}; "
                        "expected a typer.Typer or a function")
    command.name = plugin.name
    return command


def load_error(plugin: Plugin) -> Optional[str]:
    """Why the plug-in does not load (``'ExcType: message'``), or None when it does."""
    try:
        load_command(plugin)
    except Exception as exc:  # a plug-in may fail in any way; report, never propagate
        return f"{type(exc).__name__}: {exc}"
    return None


class PluginGroup(TyperGroup):
    """The top-level group: built-in commands first, then plug-ins, loaded on use."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._plugins: Optional[list[Plugin]] = None
        self._loaded: dict[str, Any] = {}

    def plugins(self) -> list[Plugin]:
        """All entry points of the group, shadowed ones included (discovered once)."""
        if self._plugins is None:
            self._plugins = discover(reserved=self.commands)
        return self._plugins

    def _active(self, name: str) -> Optional[Plugin]:
        if name in self.commands:
            return None
        return next((p for p in self.plugins() if p.name == name and not p.shadowed_by), None)

    def list_commands(self, ctx: Any) -> list[str]:
        active = sorted({p.name for p in self.plugins() if not p.shadowed_by})
        return [*super().list_commands(ctx), *active]

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        command = super().get_command(ctx, cmd_name)
        if command is not None:
            return command
        plugin = self._active(cmd_name)
        if plugin is None:
            return None
        if cmd_name in self._loaded:
            return self._loaded[cmd_name]
        # A stand-in for help listings and completion; resolve_command loads the real one.
        return TyperCommand(cmd_name, help=plugin.help_text,
                            rich_help_panel=PANEL)

    def resolve_command(self, ctx: Any, args: list[str]) -> Any:
        name, command, rest = super().resolve_command(ctx, args)
        plugin = self._active(name) if name is not None else None
        if plugin is not None:
            command = self._load(plugin)
        return name, command, rest

    def _load(self, plugin: Plugin) -> Any:
        if plugin.name not in self._loaded:
            try:
                self._loaded[plugin.name] = load_command(plugin)
            except Exception as exc:  # report which package to fix instead of a traceback
                typer.echo(
                    f"Error: the command '{plugin.name}' could not be loaded.\n"
                    f"  It comes from the {plugin.describe()}.\n"
                    f"  {type(exc).__name__}: {exc}\n"
                    f"Fix or reinstall {plugin.distribution}, or uninstall it.",
                    err=True,
                )
                raise typer.Exit(1) from exc
        return self._loaded[plugin.name]
