"""`async_save`: a checkpoint written in the background while training goes on.

The call plans the save in the caller, as `save` does (`plan.plan_save`: what needs the process
group and is cheap), copies this rank's tensors into the shared buffer of the background process
(`background`: kept for the next saves, pinned when the tensors are on CUDA) and returns an
`AsyncSave` handle. The same writer as `save`'s (`executor.execute`) then runs in this rank's
background process (`save_worker`), the ranks meeting through markers in the staging directory
(`rendezvous.Markers`, no process group). The in-flight owner (`inflight.OWNER`) holds the
process, its buffer and the handle: at most one save is in flight per process, and the next
`async_save` or `save` first waits for it.
"""
from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Union

import torch

from .buffer_layout import copy_into, nbytes
from .collectives import all_gather_json
from .errors import CheckpointError, describe
from .handle import AsyncSave, AsyncSaveWarning
from .inflight import OWNER
from .module_tensors import with_whole_tensors
from .plan import plan_save

__all__ = ["async_save", "AsyncSave", "AsyncSaveWarning", "stop_async_saves", "DEFAULT_TIMEOUT"]

DEFAULT_TIMEOUT = 600.0  # seconds the ranks' background processes wait for each other's files
# the worker's first lines, before its imports (seconds): it dies with this process (Linux), or
# exits when this process is already gone; then the worker proper (`save_worker.main`)
PROLOGUE = ("import os, sys\nif sys.platform.startswith('linux'):\n    import ctypes, signal\n"
            "    ctypes.CDLL('libc.so.6').prctl(1, signal.SIGKILL)\n"
            "if os.getppid() != int(sys.argv[3]):\n    os._exit(1)\n")
_WORKER = PROLOGUE + "from nnscaler.ckpt.save_worker import main\nmain(sys.argv[1:])\n"


def __getattr__(name: str):
    if name == "_SAVER":  # the background process under its earlier name (tests, the crash driver)
        return OWNER.background
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def stop_async_saves() -> None:
    """Wait for this process's save in flight, then end its background save process (the next
    `async_save` starts a new one). Also runs at exit."""
    OWNER.stop()


@with_whole_tensors(writeback=False)
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
        buffer = background.ensure_buffer(nbytes(plan.specs), any(t.is_cuda for _, t in tensors))
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
