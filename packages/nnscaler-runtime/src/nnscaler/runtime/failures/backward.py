"""A backward pass that raises on this rank still tells the peers (notices.py).

The generated forward hooks its outputs (`watch_backward`); the first gradient arriving in a pass
queues a callback on the autograd engine (`_PassEnd`). The engine runs it when the pass succeeds
and drops it unrun when the pass raises: the dropped callback catches the pass's error as it
leaves the engine and posts this rank's failure notice, so peers blocked in a gradient all-reduce
raise with this rank's error instead of waiting for its process to exit.
"""
from __future__ import annotations

import sys
from typing import Any, Optional

import torch
import torch.distributed as dist

from nnscaler.ir import iter_tensors as _tensors

from . import notices

__all__ = ["watch_backward"]


class _PassEnd:
    """Queued on the autograd engine at the start of a backward pass through the module's outputs.
    The engine runs it when the pass succeeds; when the pass raises, the engine drops it unrun and
    `on_failure(error)` is called with the pass's error (None where it cannot be caught)."""

    __slots__ = ("ran", "on_failure")

    def __init__(self, on_failure):
        self.ran = False
        self.on_failure = on_failure

    def __call__(self) -> None:
        self.ran = True

    def __del__(self):
        if self.ran:
            return
        try:
            if not _catch_leaving_error(self.on_failure):
                self.on_failure(None)
        except Exception:  # noqa: BLE001 - never raise from __del__
            pass


def _backward_failed(exc: Optional[BaseException]) -> None:
    if notices.failed() is not None or not notices.multi_rank():
        return  # a peer's failure raised in this pass (already known), or nobody to tell
    if exc is None:
        notices.post(f"rank {dist.get_rank()} failed in backward (its error is in its own log)")
    else:
        notices.report(exc, "backward")


def _catch_leaving_error(callback) -> bool:
    """The engine is about to raise the pass's error into the Python frames that called it: trace
    those frames until it arrives and pass it to `callback`. False where that cannot be done:
    another tracer (a debugger, coverage) is active and left alone, or no Python frame called
    the engine (a device thread)."""
    if sys.gettrace() is not None:
        return False
    try:
        frame = sys._getframe(2)  # _catch_leaving_error <- __del__ <- (the C++ engine) the caller
    except ValueError:
        return False
    frames = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back

    def stop() -> None:
        for f in frames:
            f.f_trace = None
        sys.settrace(None)

    def on_event(frame, event, arg):
        if event == "exception":
            stop()
            try:
                callback(arg[1])
            except Exception:  # noqa: BLE001
                pass
            return None
        if event == "return" and frame is frames[-1]:
            stop()  # left the outermost frame without an error: nothing to catch
        return on_event

    for f in frames:
        f.f_trace_lines = False
        f.f_trace = on_event
    sys.settrace(_no_new_frames)
    return True


def _no_new_frames(frame, event, arg):
    return None


def _on_backward_start(grad):
    state = notices.state()
    task = torch._C._current_graph_task_id() if hasattr(torch._C, "_current_graph_task_id") else None
    if task is None or task != state.backward_task:
        state.backward_task = task
        try:
            torch.autograd.Variable._execution_engine.queue_callback(_PassEnd(_backward_failed))
        except RuntimeError:  # not inside a backward pass (cannot happen from a tensor hook)
            pass
    return None


def watch_backward(outputs: Any) -> None:
    """Watch the backward passes through `outputs` (a forward's result): a pass that raises posts
    this rank's failure notice. One hook per output tensor with a gradient graph."""
    if not notices.multi_rank() or not torch.is_grad_enabled():
        return
    for t in _tensors(outputs):
        if t.grad_fn is not None:
            t.register_hook(_on_backward_start)
