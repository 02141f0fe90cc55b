"""Preemption: SIGTERM (what SLURM and Kubernetes send before they reclaim a node; torchrun's agent
forwards it to its workers) asks the Trainer to stop after the step in progress; so does SIGINT
(Ctrl-C: the terminal sends it to every process of the group, the workers included).

    watch = PreemptionWatch()          # installs the handler (main thread only)
    ... after each step:
    if watch.requested():              # collective: every rank calls it after the same step
        save a checkpoint, print the step, leave the loop
    watch.close()                      # the previous handler is back

The handler only records the signal. `requested` agrees across ranks (an all-reduce MAX of one
flag), so a rank that got the signal and one that did not stop after the same step.
"""
from __future__ import annotations

import signal
import threading
from typing import Dict, Optional, Sequence

import torch
import torch.distributed as dist
from nnscaler.runtime import default_device, failures

__all__ = ["PreemptionWatch", "PREEMPTION_SIGNALS"]

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class PreemptionWatch:
    """Records the preemption signals this process receives (see the module docstring)."""

    def __init__(self, signals: Sequence[int] = PREEMPTION_SIGNALS):
        self.received: Optional[int] = None  # the first signal number received
        self._previous: Dict[int, object] = {}
        if threading.current_thread() is threading.main_thread():  # signal.signal works there only
            for sig in signals:
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame) -> None:
        if self.received is None:
            self.received = signum

    @property
    def installed(self) -> bool:
        """False off the main thread, where no handler can be set (the signal keeps its action)."""
        return bool(self._previous)

    def requested(self) -> bool:
        """Whether any rank has received the signal. Collective over the default process group
        (one all-reduce of one flag): every rank must call it at the same point."""
        local = self.received is not None
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return local
        device = default_device() if dist.get_backend() == "nccl" else torch.device("cpu")
        flag = torch.tensor([int(local)], dtype=torch.int32, device=device)
        failures.run(dist.all_reduce, flag, op=dist.ReduceOp.MAX, what="the preemption check's all-reduce")
        return bool(flag.item())

    def close(self) -> None:
        """Put back the handlers that were there before."""
        for sig, previous in self._previous.items():
            signal.signal(sig, signal.SIG_DFL if previous is None else previous)  # None: set outside Python
        self._previous = {}

    def __enter__(self) -> "PreemptionWatch":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
