"""Failures reach every rank: a rank that raises in a step makes every other rank raise too.

Without this, a rank that raises inside forward or backward while its process stays alive (the
user's loop logs the error and goes on, a debugger stops there) leaves its peers blocked in the
next collective they share with it (the gradient all-reduce, a tensor-parallel collective, ZeRO's
reduce-scatter) until that process exits.

The protocol (CPU / gloo collectives), one module per part:

* **Failure notice** (notices.py). A rank whose step raises writes a notice into the job's
  rendezvous store: its rank and its error (``rank 1 failed in forward: ValueError: ...``). A
  forward failure is seen by `ParallelModule.forward` (`report`); a backward failure by a callback
  that every backward pass through the module's outputs queues on the autograd engine
  (backward.py, `watch_backward`).
* **Watchful waits** (waits.py). Every collective nnscaler issues during a step (the Reducer's
  bucket all-reduces, ZeRO's reduce-scatter / all-reduce / all-gather, the tensor-parallel
  collectives of `nnscaler.runtime.comm`, the gradient-norm all-reduce) goes through `run` /
  `wait`: launched asynchronously and waited for in slices of `POLL_S` seconds, reading one store
  counter between slices. So every rank raises `PeerFailedError` naming the failed rank and its
  error at its first collective that waits on it (directly or through a rank that already raised).
  The pipeline executor reports its ranks' failures too (for the data-parallel peers in other
  units; its own poison messages serve the pipeline).
* **Dead peers** (peers.py). A rank killed outright posts nothing; the survivor names it from the
  host and pid each rank registered (`arm`): "rank 1 died", whatever the collective it was in.
  Blocking operations that are not polled (pipeline sends / receives, parallelize) pass the
  backend's error to `lost_peer` for the same error.
* **The backends' messages** (backends.py): the one table of what gloo and NCCL say for a lost
  peer, their timeout and the end of a slice, with the torch versions it was checked against.
* **Uncaught exceptions** (uncaught.py). `install_excepthook` wraps ``sys.excepthook`` so that a
  process ended by an uncaught exception posts a notice first. `arm` installs it: when a
  ParallelModule is built and when `parallelize` starts. Importing nnscaler does not.
* **Stalls** (stalls.py). A rank that stops taking part without failing inside nnscaler posts
  nothing: once the default process group's timeout has passed, the waiting ranks raise
  `CollectiveTimeoutError` naming the ranks that never arrived.
* **Broken state.** After a failure (its own or a peer's) a process refuses later steps with
  `StepRefusedError` (`check_step`): the ranks' collectives are out of step, only a restart helps.

Why a side channel rather than a notice carried by the collective the peers wait for: the failing
rank would have to issue exactly the collective each peer is blocked in, with the same size, and
only its generated code knows which tensor-parallel collective comes next; the store reaches every
rank whatever it waits for, costs one small write on failure and nothing on the fast path.

Not covered: NCCL (device) collectives are not polled (the CPU does not block in them; use
``TORCH_NCCL_ASYNC_ERROR_HANDLING`` and the process-group timeout there: NCCL's watchdog ends the
process, without naming the missing ranks); a backward pass that fails before it reaches the
module's outputs (in the user's loss code) posts no notice; a notice left by an earlier process
group on the same store is seen by a later one.

`failures.enabled = False` turns the protocol off in this process (plain waits, no notices, no
hooks): for measuring its cost (bench/failure_overhead.py). Every rank must agree.
"""
from __future__ import annotations

import sys
import types

from . import notices as _notices
from .backward import watch_backward
from .errors import CollectiveTimeoutError, PeerFailedError, StepRefusedError
from .notices import check_step, failed, report, reset
from .peers import lost_peer
from .uncaught import call_site, install as install_excepthook, summary
from .waits import POLL_S, run, wait

__all__ = [
    "PeerFailedError", "StepRefusedError", "CollectiveTimeoutError",  # what a rank raises
    "arm", "install_excepthook",  # set up this process (a ParallelModule and parallelize call arm)
    "check_step", "report", "watch_backward", "failed", "reset",  # this rank's steps
    "run", "wait", "lost_peer", "POLL_S",  # waiting for peers
    "summary", "call_site",  # an exception and the user's line, in one line
    "enabled",
]


def arm() -> None:
    """Make this process's failures reach its peers: register it (host, pid) so that peers can tell
    it died, and install the excepthook (`install_excepthook`). Called when a ParallelModule is
    built and when `parallelize` starts; cheap and idempotent."""
    install_excepthook()
    _notices.register()


class _Package(types.ModuleType):
    """The package's module type: `enabled` reads and sets the switch the other modules consult."""

    @property
    def enabled(self) -> bool:
        return _notices.enabled

    @enabled.setter
    def enabled(self, on: bool) -> None:
        _notices.enabled = bool(on)


sys.modules[__name__].__class__ = _Package
