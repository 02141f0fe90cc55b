"""`async_save`: a checkpoint written in the background while training goes on.

The call plans the save in the caller, as `save` does (`plan.plan_save`: what needs the process
group and is cheap), copies this rank's tensors into the shared buffer of the background process
(`background`: kept for the next saves, pinned when the tensors are on CUDA) and returns an
`AsyncSave` handle. The same writer as `save`'s (`executor.execute`) then runs in this rank's
background process (`save_worker`), the ranks meeting through markers in the staging directory
(`rendezvous.Markers`, no process group). The in-flight owner (`inflight.OWNER`) holds the
process, its buffer and the handle: at most one save is in flight per process, and the next
`async_save` or `save` first waits for it.

The first `async_save` of a process would also make the buffer (and pay a page fault for each of
its pages at the copy) and start the process; `prepare_async_save` does both ahead (the Trainer
calls it at set-up with ``checkpoint.async_save``), sizing the buffer from the same description of
the rank's tensors (`rank_state.collect`, `buffer_need`) as `async_save`.
"""
from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Sequence, Tuple, Union

import torch

from .buffer_layout import copy_into, nbytes, spec_of
from .collectives import all_gather_json, rank_and_world
from .errors import CheckpointError, describe
from .handle import AsyncSave, AsyncSaveWarning
from .inflight import OWNER
from .plan import plan_save
from .rank_state import collect

__all__ = ["async_save", "prepare_async_save", "AsyncSave", "AsyncSaveWarning", "stop_async_saves",
           "DEFAULT_TIMEOUT", "HEADROOM"]

DEFAULT_TIMEOUT = 600.0  # seconds the ranks' background processes wait for each other's files
# the worker's first lines, before its imports (seconds): it dies with this process (Linux), or
# exits when this process is already gone; then the worker proper (`save_worker.main`)
PROLOGUE = ("import os, sys\nif sys.platform.startswith('linux'):\n    import ctypes, signal\n"
            "    ctypes.CDLL('libc.so.6').prctl(1, signal.SIGKILL)\n"
            "if os.getppid() != int(sys.argv[3]):\n    os._exit(1)\n")
_WORKER = PROLOGUE + "from nnscaler.ckpt.save_worker import main\nmain(sys.argv[1:])\n"
HEADROOM = 1 << 20  # bytes prepare_async_save adds for the tensors of the extras to come (a grad scaler's, ...)


def __getattr__(name: str):
    if name == "_SAVER":  # the background process under its earlier name (tests, the crash driver)
        return OWNER.background
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def buffer_need(tensors: Sequence[Tuple[str, torch.Tensor]]) -> Tuple[int, bool]:
    """(bytes of shared buffer `tensors` take, in the plan's layout; whether it is to be pinned: a
    tensor lives on CUDA): what `async_save` asks of the buffer and `prepare_async_save` sizes for."""
    return nbytes([spec_of(k, t) for k, t in tensors]), any(t.is_cuda for _, t in tensors)


def prepare_async_save(module: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *,
                       extra: Optional[Dict[str, Any]] = None) -> int:
    """Make this rank's shared buffer and start its background save process now, so that the first
    `async_save` afterwards blocks no longer than the later ones (instead of also making the buffer,
    paying a page fault per page of it at the copy, and starting the process). Call it once the
    optimizer exists, e.g. at set-up, on every rank (not a collective: fully sharded parameters
    count as the shards this rank holds, as `async_save` copies them).

    The buffer is sized as ``async_save(path, module, optimizer, extra=extra)`` would need it
    (kind ``"sharded"``, the larger kind), from the same description of the rank's tensors, with
    the state each optimizer parameter gets at its first step where it holds none yet (Adam's
    ``exp_avg`` / ``exp_avg_sq`` appear then: found by stepping the optimizer's class once over a
    3-element stand-in, see `optimizer_tensors.with_first_step_state`), plus `HEADROOM` (1 MiB)
    for the tensors of the extras to come; every page is written once. A save that needs more
    still grows it (and restarts the process) then. Idempotent: a later call with the same module
    and optimizer sizes nothing again and only restarts the process if it is gone (after
    `stop_async_saves`). Returns the buffer's size in bytes."""
    background = OWNER.background
    if not background.prepared_for(module, optimizer):
        rank, _ = rank_and_world()
        need, pin = buffer_need(collect(module, optimizer, extra, rank, first_step=True).tensors)
        background.ensure_buffer(need + HEADROOM, pin, touch=True)
        background.mark_prepared(module, optimizer)
    background.start(_WORKER)
    return background.buffer.numel()


def stop_async_saves(*, release: bool = False) -> None:
    """Wait for this process's save in flight, then end its background save process (the next
    `async_save` starts a new one). Also runs at exit. `release`: also free the shared buffer (the
    next `async_save` or `prepare_async_save` makes a new one)."""
    OWNER.stop(release=release)


def async_save(path, module: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *,
               kind: str = "sharded", extra: Optional[Dict[str, Any]] = None, overwrite: bool = False,
               files: Optional[Mapping[str, Union[bytes, str]]] = None,
               timeout: float = DEFAULT_TIMEOUT) -> AsyncSave:
    """`save`, written in the background: COLLECTIVE like `save` (same arguments); returns once
    this rank's state is copied (training may then change it), with a handle whose ``wait()``
    returns once the checkpoint is committed (or raises its error) and ``done()`` tells whether it
    finished. `timeout`: seconds the ranks' background processes wait for each other's files."""
    OWNER.settle()
    plan, tensors = plan_save(path, module, optimizer, kind=kind, extra=extra, overwrite=overwrite, files=files,
                              tag=True, timeout=timeout)
    error: Optional[str] = None
    background = OWNER.background
    try:
        buffer = background.ensure_buffer(*buffer_need(tensors))
        copy_into(buffer, tensors)
        background.start(_WORKER)
    except Exception as e:  # noqa: BLE001 - every rank must learn of it
        error = describe(e, plan.rank)
    failed = [e for e in all_gather_json(error) if e]
    if failed:
        if plan.rank == 0:
            plan.staging.discard()
        raise CheckpointError(failed[0])
    handle = background.submit(plan)
    OWNER.track(handle)
    return handle
