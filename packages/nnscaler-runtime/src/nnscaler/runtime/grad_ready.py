"""When gradients synchronise: the one rule the Reducer (DDP, ZeRO-1's default) and the fully
sharded parameters (``use_zero=3``) share.

A gradient owner calls `BackwardPass.enter()` whenever backward hands it something (a parameter's
accumulated gradient, a unit's gradients, a tensor a recomputation gathers). The first call of a
backward pass (one autograd graph task) decides whether the pass synchronises, from the owner's
pause counter (`Pausable.sync_enabled`: not inside ``no_sync()``), and queues the owner's end of
pass on the autograd engine, so the plain loop needs no extra call. Every later call of that pass
gets the same answer, whatever happens to the pause counter meanwhile. A pass that raised before
its end is closed (without reducing) when the next one starts, or by `close()`.

Nothing here reads a device value: deciding and closing cost no host synchronisation.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

__all__ = ["BackwardPass", "graph_task_id"]


def graph_task_id() -> int:
    """The running backward pass (autograd graph task); -1 outside backward."""
    get = getattr(torch._C, "_current_graph_task_id", None)
    return get() if get is not None else 0


class BackwardPass:
    """The backward pass an owner is in, and whether it synchronises.

    `sync_enabled()`: the owner's pause state, read once per pass; `on_start()`: a new pass begins;
    `on_end(sync, reduce)`: the pass ended (`reduce` False when it raised before its end)."""

    def __init__(self, sync_enabled: Callable[[], bool], on_end: Callable[[bool, bool], None],
                 on_start: Optional[Callable[[], None]] = None):
        self._sync_enabled, self._on_end, self._on_start = sync_enabled, on_end, on_start
        self.task: Optional[int] = None  # graph task id of the running pass
        self.sync = False

    @property
    def active(self) -> bool:
        return self.task is not None

    def enter(self) -> bool:
        """Inside backward: whether this pass synchronises (decided at its first call)."""
        task = graph_task_id()
        if self.task != task:
            if self.task is not None:  # the previous pass raised before its end
                self.close(reduce=False)
            self.task, self.sync = task, self._sync_enabled()
            if self._on_start is not None:
                self._on_start()
            torch.autograd.Variable._execution_engine.queue_callback(self._end)
        return self.sync

    def _end(self) -> None:
        if self.task is not None:
            self.close(reduce=True)

    def close(self, reduce: bool) -> None:
        """End the running pass now (`reduce` False: it failed, reduce nothing)."""
        sync, self.task = self.sync, None
        self._on_end(sync, reduce)
