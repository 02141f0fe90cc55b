"""What each collective backend says, in one place: the adapter between torch.distributed's
backends and the waits of this package.

A backend reports a dead peer, its own timeout and the end of a timed wait as a RuntimeError whose
text is all there is to tell them apart. `BACKENDS` lists, per backend, the texts the waits act on
(matched case-insensitively as substrings), what each one means, where it was seen, and the torch
versions the table was checked against; `meaning(exc)` reads an error with it. Nothing else in
nnscaler matches a backend's error text.

gloo (CPU tensors) was checked by killing a peer in each collective kind on real gloo processes
(tests/runtime/test_failures_gloo.py: all-reduce, all-gather, reduce-scatter, all-to-all,
broadcast, barrier, send / recv; killed while the survivor waits, and in the middle of a transfer)
and by letting its timeout pass. NCCL (device tensors) is not polled (the CPU does not block in
its collectives); its texts are NCCL's and ProcessGroupNCCL's own, not reproduced here (that needs
two GPUs).

Two behaviours of gloo that the waits must respect, also here:
- `runs_in_wait`: gloo runs a reduce-scatter inside ``work.wait()`` (the work is not started
  before and ignores the wait's timeout): such work is waited for on a helper thread.
- `timed_wait_breaks`: a timed ``wait`` on gloo send / receive work that ends before the message
  arrived ("Timed out waiting 250ms for recv operation to complete") closes every connection of the
  process ("Application timeout caused pair closure" from then on, "Connection closed by peer" on
  the peer): such work is waited for on a helper thread too.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.distributed as dist

__all__ = ["Message", "Backend", "BACKENDS", "SLICE_END", "PEER_LOST", "TIMED_OUT", "CLOSED_AFTER_TIMEOUT",
           "meaning", "runs_in_wait", "timed_wait_breaks", "polled"]

# What a message means to the waits:
SLICE_END = "slice end"  # work.wait(timeout) returned because the slice ended: not an error, wait on
PEER_LOST = "peer lost"  # a peer's connection is gone: it died (or left the collective)
TIMED_OUT = "timed out"  # the backend's own timeout (the process group's) passed
CLOSED_AFTER_TIMEOUT = "closed after a timeout"  # an earlier timeout in this process closed its connections


@dataclass(frozen=True)
class Message:
    text: str  # a part of the backend's error text (compared case-insensitively)
    means: str  # SLICE_END, PEER_LOST, TIMED_OUT or CLOSED_AFTER_TIMEOUT
    seen: str  # where it comes from, and where it was reproduced


@dataclass(frozen=True)
class Backend:
    name: str
    checked: Tuple[str, ...]  # torch versions on which its messages were reproduced (empty: never)
    polled: bool  # its work is waited for in slices (CPU tensors) rather than plainly
    messages: Tuple[Message, ...]


_KILLED_ANYWHERE = "a peer SIGKILLed before or while this rank waits, in every collective kind and in send / recv"
_KILLED_MID_TRANSFER = ("a peer SIGKILLed in the middle of a large transfer (all-reduce, all-gather, reduce-scatter, "
                        "all-to-all, reduce)")

GLOO = Backend("gloo", checked=("2.13.0",), polled=True, messages=(
    Message("Operation timed out!", SLICE_END, "c10d's Work.wait(timeout) on a collective whose slice ended"),
    Message("Connection closed by peer", PEER_LOST, _KILLED_ANYWHERE),
    Message("Connection reset by peer", PEER_LOST, f"'Read error ...: Connection reset by peer': {_KILLED_MID_TRANSFER}"),
    Message("Broken pipe", PEER_LOST, "'Write error ...: Broken pipe': a write to a dead peer (kept from earlier torch "
                                      "versions; not reproduced on 2.13)"),
    Message("Connection refused", PEER_LOST, "connecting to a dead peer (kept from earlier torch versions; not "
                                             "reproduced on 2.13)"),
    Message("Timed out waiting", TIMED_OUT, "'Timed out waiting <ms>ms for recv|send operation to complete': the "
                                            "process group's timeout passed (every collective kind and send / recv)"),
    Message("Application timeout caused pair closure", CLOSED_AFTER_TIMEOUT,
            "every operation of a process after one of its waits timed out"),
))
NCCL = Backend("nccl", checked=(), polled=False, messages=(
    Message("remote process exited or there was a network error", PEER_LOST,
            "ncclRemoteError (NCCL's ncclGetErrorString); not reproduced here: needs two GPUs"),
    Message("Watchdog caught collective operation timeout", TIMED_OUT,
            "ProcessGroupNCCL's watchdog at the process group's timeout; not reproduced here"),
))
BACKENDS: Tuple[Backend, ...] = (GLOO, NCCL)


def meaning(exc: BaseException) -> Optional[str]:
    """What the backend error `exc` means (SLICE_END, PEER_LOST, TIMED_OUT, CLOSED_AFTER_TIMEOUT),
    None for any other error (a bug, a mismatch between the ranks' collectives: it stands). The
    texts of the backends do not overlap, so the backend itself need not be known."""
    if not isinstance(exc, RuntimeError):
        return None
    text = str(exc).strip()
    low = text.lower()
    for backend in BACKENDS:
        for message in backend.messages:
            if message.means == SLICE_END and text != message.text:
                continue  # the exact text only: a longer one is an error that mentions it
            if message.text.lower() in low:
                return message.means
    return None


# gloo runs these inside `work.wait()` itself (the work is not started before, and ignores a wait
# timeout); checked on torch 2.13.
_RUNS_IN_WAIT = {f for f in (getattr(dist, "reduce_scatter_tensor", None), getattr(dist, "reduce_scatter_single", None))
                 if f is not None}


def runs_in_wait(fn) -> bool:
    """Whether the collective `fn` (a torch.distributed function) runs inside ``work.wait()`` on
    gloo: its work must be waited for on a helper thread."""
    return fn in _RUNS_IN_WAIT


def _point_to_point_types() -> frozenset:
    op_type = getattr(getattr(torch._C, "_distributed_c10d", None), "OpType", None)
    members = getattr(op_type, "__members__", {})
    return frozenset(int(members[n]) for n in ("SEND", "RECV", "RECVANYSOURCE") if n in members)


_POINT_TO_POINT = _point_to_point_types()


def timed_wait_breaks(work) -> bool:
    """Whether a timed ``work.wait(timeout)`` that ends early would close this process's
    connections: gloo's send / receive work (told by ``Work._get_op_type``, checked on torch 2.13;
    work whose type cannot be read counts as a collective, waited for in slices as before)."""
    get = getattr(work, "_get_op_type", None)
    if get is None or not _POINT_TO_POINT:
        return False
    try:
        return int(get()) in _POINT_TO_POINT
    except Exception:  # noqa: BLE001 - an unreadable type: a collective
        return False


def polled(tensor: Optional[torch.Tensor]) -> bool:
    """Whether work on `tensor` is waited for in slices: CPU tensors (gloo) are, device tensors
    (NCCL: the CPU does not block in them) are waited for plainly."""
    return tensor is None or tensor.device.type == "cpu"
