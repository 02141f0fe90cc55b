"""What autodist is measuring, as it goes: a hook for progress reports.

The first search on a machine profiles every distinct op, then the whole graph, the CPU sharing,
the optimizer and the collectives (minutes on a loaded CPU); later searches find them in the
cache. Each measurement announces itself as a `ProfileProgress` (what, which one, n of N) to the
hook set with `set_progress_hook` (the trainer or a CLI renders it). With no hook set, a rich
progress bar is drawn on a terminal when rich is installed (nnscaler-policies does not depend on
it: the ``cli`` extra, nnscaler-cli and nnscaler-trainer bring it), else each report is a line
on the ``nnscaler.policies.autodist`` logger (INFO).
"""
from __future__ import annotations

import contextlib
import logging
import sys
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

__all__ = ["ProfileProgress", "set_progress_hook", "progress_hook", "task"]

_log = logging.getLogger("nnscaler.policies.autodist")


@dataclass(frozen=True)
class ProfileProgress:
    """One report: `kind` of measurement ("op", "graph", "cpu sharing", "optimizer",
    "collectives"), `label` of the item measured now (an op: its kind and argument shapes), its
    number `done` (1-based) of `total`; ``done == total`` with ``finished`` closes the task."""
    kind: str
    label: str
    done: int
    total: int
    finished: bool = False

    def describe(self) -> str:
        return f"autodist: profiling {self.kind} {self.done}/{self.total}: {self.label}"


Hook = Callable[[ProfileProgress], None]
_hook: Optional[Hook] = None


def set_progress_hook(hook: Optional[Hook]) -> Optional[Hook]:
    """Send progress reports to `hook` (None: the default rendering); returns the previous hook."""
    global _hook
    previous, _hook = _hook, hook
    return previous


@contextlib.contextmanager
def progress_hook(hook: Optional[Hook]) -> Iterator[None]:
    """`set_progress_hook` for the duration of a block."""
    previous = set_progress_hook(hook)
    try:
        yield
    finally:
        set_progress_hook(previous)


class _Task:
    def __init__(self, kind: str, total: int, emit: Hook):
        self.kind, self.total, self.done, self._emit = kind, total, 0, emit

    def advance(self, label: str) -> None:
        """The next item is being measured now."""
        self.done += 1
        self._emit(ProfileProgress(self.kind, label, self.done, self.total))

    def finish(self) -> None:
        self._emit(ProfileProgress(self.kind, "", self.done, self.total, finished=True))


@contextlib.contextmanager
def task(kind: str, total: int) -> Iterator[_Task]:
    """Report the measurement of `total` items of `kind` (nothing at all when `total` is 0)."""
    if total <= 0:
        yield _Task(kind, 0, lambda _: None)
        return
    with contextlib.ExitStack() as stack:
        emit = _hook if _hook is not None else stack.enter_context(_default_renderer())
        t = _Task(kind, total, emit)
        try:
            yield t
        finally:
            t.finish()


@contextlib.contextmanager
def _default_renderer() -> Iterator[Hook]:
    if sys.stderr.isatty():
        try:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
        except ImportError:  # rich comes with the `cli` extra only: plain lines then
            pass
        else:
            bar = Progress(TextColumn("autodist: profiling {task.fields[kind]}"), BarColumn(), MofNCompleteColumn(),
                           TimeElapsedColumn(), TextColumn("{task.fields[label]}", markup=False),
                           console=Console(stderr=True), transient=True)
            ids = {}

            def render(p: ProfileProgress) -> None:
                if p.kind not in ids:
                    ids[p.kind] = bar.add_task(p.kind, total=p.total, kind=p.kind, label="")
                bar.update(ids[p.kind], completed=p.done if p.finished else p.done - 1, label=p.label)

            try:
                bar.start()
            except Exception:  # noqa: BLE001 - another live display (the caller's own bar): log instead
                pass
            else:
                try:
                    yield render
                finally:
                    bar.stop()
                return
    yield lambda p: None if p.finished else _log.info(p.describe())
