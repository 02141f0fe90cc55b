"""Point-to-point messages between pipeline stages: a tensor (with a small header giving its
dtype, shape and whether it needs a gradient) or an int.

Sends are asynchronous (``isend``); a send's buffer stays referenced until `Mailbox.release`
learns it was delivered (the executor knows that from the schedule, see inbox.py) or, at the
latest, `Mailbox.wait_sends` at the end of the step. Receives block. Every message carries a tag
unique within a step (value, consuming stage, micro-batch, direction); the executor receives in
each sender's order anyway (inbox.py). Messages between two stages on the same rank
(interleaved schedules) stay in memory.

**Agreed sizes and receives posted ahead.** gloo hands a send's bytes to the socket at ``isend``
only when the peer's receive is already posted; otherwise the bytes wait until the sender's
gloo thread answers the receiver's later "ready" notice, and while the sender computes that
thread waits for a core: up to a scheduler tick (4 ms) per message was measured on 2 cores, for
messages whose data had been sent long before (bench/autodist.py, the pipeline case). A payload's
size is only known from its header, so a receiver could not post it ahead. Here both sides agree
on each message's payload size without talking: the size the same message (peer, tag) had in the
previous step (every rank runs the same steps, so the sender's and the receiver's records are the
same). A tensor goes as its header (tag ``3t``), then, when a size is agreed, a payload of exactly
that many bytes (``3t + 1``): the tensor's bytes when its size is the agreed one, else padding;
and when its size is not the agreed one (the first step, a shape that changed), its bytes again
under ``3t + 2``. The receiver (`post`) posts the header and the agreed payload before it needs
them, so the common message is written by the sender at once. Only on a backend that matches
messages by tag (gloo, ``post_ahead``); NCCL matches them in issue order, and there a tensor is
its header and its payload (``3t + 2``), each received when needed, in the sender's order.

**A peer that died.** A peer process that exits (killed, or ended by an uncaught exception) makes
gloo fail the pending send or receive with "Connection closed by peer" / "Connection reset by
peer"; every send and receive here turns that into the `PeerFailedError` the data-parallel
collectives raise (failures/): the rank, and the error it reported before exiting or that it died.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from .. import failures
from ..errors import NnScalerError

__all__ = ["Mailbox", "PeerFailure", "HEADER_LEN", "MAX_DIMS", "tensor_header", "empty_from_header"]

MAX_DIMS = 12
HEADER_LEN = 3 + MAX_DIMS  # dtype code, requires_grad, ndim, dims
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128]
_CODE = {d: i for i, d in enumerate(_DTYPES)}


# A failed rank sends, in place of the messages its peers wait for, a "poison": a tensor header
# whose dtype code is _POISON (with the failed rank, stage and micro-batch), or _INT_POISON for
# an int message. Same size and tag as the real message, so it matches on gloo and on NCCL.
_POISON = -1
_INT_POISON = -(2 ** 63)


class PeerFailure(NnScalerError):
    """Another pipeline rank failed during this step (its own error says why)."""

    def __init__(self, src: int, stage: int = -1, micro: int = -1):
        where = f" in stage {stage}, micro-batch {micro}" if stage >= 0 else ""
        super().__init__(f"pipeline rank {src} failed{where} (its own error says why); this rank stopped waiting "
                         f"for it")
        self.src = src


@contextmanager
def _peer_lost(peer: int, what: str):
    """gloo's lost-connection error from a message with `peer` as `PeerFailedError` (failures/)."""
    try:
        yield
    except RuntimeError as exc:
        if isinstance(exc, NnScalerError):  # a poison (PeerFailure) or an error of ours: not gloo's
            raise
        lost = failures.lost_peer(exc, f"the pipeline's {what} rank {peer}", ranks=(peer,))
        if lost is None:
            raise
        raise lost from None


def tensor_header(x: torch.Tensor) -> torch.Tensor:
    """The int64 header describing `x`: dtype code, requires_grad, ndim, dims (zero padded)."""
    if x.dim() > MAX_DIMS:
        raise ValueError(f"pipeline messages carry tensors of at most {MAX_DIMS} dims, got {x.dim()}")
    if x.dtype not in _CODE:
        raise TypeError(f"pipeline messages cannot carry dtype {x.dtype}")
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[0], header[1], header[2] = _CODE[x.dtype], int(x.requires_grad), x.dim()
    header[3:3 + x.dim()] = torch.tensor(x.shape, dtype=torch.int64)
    return header


def empty_from_header(header: torch.Tensor, device) -> torch.Tensor:
    """An uninitialised tensor of the dtype / shape / requires_grad a header describes."""
    h = header.tolist()
    return torch.empty(h[3:3 + h[2]], dtype=_DTYPES[h[0]], device=device).requires_grad_(bool(h[1]))


class Mailbox:
    """One rank's sends and receives for the steps of one pipeline executor."""

    def __init__(self, rank: int, device: torch.device, post_ahead: bool = False):
        self.rank, self.device = rank, device
        self.post_ahead = post_ahead  # receives may be posted before they are needed (tag matching)
        self._pending: List[Tuple[object, torch.Tensor, int, Any]] = []  # (work, buffer, dst, key)
        self._local: Dict[int, object] = {}
        self._poison: List[Tuple[object, torch.Tensor]] = []  # failure notices, kept alive unwaited
        self._posted: Dict[Tuple[int, int], _Posted] = {}  # (src, tag) -> receives posted ahead
        # payload bytes of each (peer, tag) message: this step's, and the previous step's (agreed)
        self._sizes: Dict[Tuple[str, int, int], int] = {}
        self._agreed: Dict[Tuple[str, int, int], int] = {}
        self.sent_keys: set = set()  # (dst, key) of this step's sends to other ranks
        self.bytes_sent = 0
        self.messages = 0
        # payload bytes of sends not yet released (their buffers stay referenced), and the peak
        self.held_bytes = 0
        self.peak_held_bytes = 0

    def new_step(self) -> None:
        """Agree on this step's payload sizes: last step's (the same on the sending rank)."""
        if self._posted:  # pragma: no cover - an executor bug, not a user error
            raise RuntimeError(f"pipeline: receives posted but never read: {sorted(self._posted)[:5]}")
        self._agreed = dict(self._sizes)

    # -- tensors ------------------------------------------------------------------------------
    def send_tensor(self, x: torch.Tensor, dst: int, tag: int, key: Any = None) -> None:
        """Send `x` without waiting; `key` names the message for `release`."""
        if dst == self.rank:
            self._local[tag] = x
            return
        header = tensor_header(x)
        payload = x.detach().contiguous().reshape(-1).view(torch.uint8)
        n, agreed = payload.numel(), self._agreed.get(("to", dst, tag)) if self.post_ahead else None
        self._isend(header.to(self.device), dst, 3 * tag, key)
        if agreed is not None:
            self._isend(payload if n == agreed else torch.empty(agreed, dtype=torch.uint8, device=self.device),
                        dst, 3 * tag + 1, key)
        if n != agreed:
            self._isend(payload, dst, 3 * tag + 2, key)
        self._sizes[("to", dst, tag)] = n
        self.bytes_sent += n

    def post(self, src: int, tag: int, is_int: bool = False) -> None:
        """Post the receive of the message `tag` from `src` now, before it is needed, so that the
        sender's ``isend`` writes it at once (only with `post_ahead`; else nothing)."""
        if not self.post_ahead or src == self.rank or (src, tag) in self._posted:
            return
        with _peer_lost(src, "receive from"):
            self._posted[(src, tag)] = self._irecv_header(src, tag, is_int)

    def recv_tensor(self, src: int, tag: int) -> torch.Tensor:
        """The tensor sent to this rank with `tag` (detached; requires_grad as the sender's)."""
        if src == self.rank:
            x = self._local.pop(tag)
            return x.detach().requires_grad_(x.requires_grad)
        with _peer_lost(src, "receive from"):
            return self._recv_tensor(src, tag)

    def _recv_tensor(self, src: int, tag: int) -> torch.Tensor:
        posted = self._posted.pop((src, tag), None) or self._irecv_header(src, tag, False)
        posted.header_work.wait()
        header = posted.header
        if int(header[0]) == _POISON:
            self._poison.append((posted.payload_work, posted.payload))
            raise PeerFailure(src, int(header[2]), int(header[3]))
        x = empty_from_header(header, self.device)
        grad, n = x.requires_grad, x.numel() * x.element_size()
        self._sizes[("from", src, tag)] = n
        if posted.payload is not None:
            posted.payload_work.wait()
            if posted.payload.numel() == n:
                return posted.payload.view(x.dtype).view(x.shape).requires_grad_(grad)
        dist.recv(x.requires_grad_(False).reshape(-1).view(torch.uint8), src=src, tag=3 * tag + 2)
        return x.requires_grad_(grad)

    def _irecv_header(self, src: int, tag: int, is_int: bool) -> "_Posted":
        if is_int:
            buf = torch.empty(1, dtype=torch.int64, device=self.device)
            return _Posted(buf, dist.irecv(buf, src=src, tag=3 * tag), None, None)
        header = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
        work = dist.irecv(header, src=src, tag=3 * tag)
        agreed = self._agreed.get(("from", src, tag)) if self.post_ahead else None
        if agreed is None:
            return _Posted(header, work, None, None)
        payload = torch.empty(agreed, dtype=torch.uint8, device=self.device)
        return _Posted(header, work, payload, dist.irecv(payload, src=src, tag=3 * tag + 1))

    # -- ints ---------------------------------------------------------------------------------
    def send_int(self, value: int, dst: int, tag: int, key: Any = None) -> None:
        if dst == self.rank:
            self._local[tag] = int(value)
            return
        self._isend(torch.tensor([int(value)], dtype=torch.int64, device=self.device), dst, 3 * tag, key)

    def recv_int(self, src: int, tag: int) -> int:
        if src == self.rank:
            return self._local.pop(tag)
        with _peer_lost(src, "receive from"):
            posted = self._posted.pop((src, tag), None) or self._irecv_header(src, tag, True)
            posted.header_work.wait()
        value = int(posted.header.item())
        if value == _INT_POISON:
            raise PeerFailure(src)
        return value

    # -- failure --------------------------------------------------------------------------------
    def send_poison(self, dst: int, tag: int, is_int: bool, stage: int, micro: int) -> None:
        """Tell `dst`, in place of the message with `tag`, that this rank failed. Not waited for
        (the peer may never post that receive); a send that cannot go out is ignored."""
        if is_int:
            buf = torch.tensor([_INT_POISON], dtype=torch.int64, device=self.device)
        else:
            buf = torch.zeros(HEADER_LEN, dtype=torch.int64, device=self.device)
            buf[0], buf[1], buf[2], buf[3] = _POISON, self.rank, stage, micro
        try:
            self._poison.append((dist.isend(buf, dst=dst, tag=3 * tag), buf))
        except Exception:  # noqa: BLE001 - the peer may be gone already; the local error is what matters
            pass

    def abandon(self) -> None:
        """Forget the step's messages after a failure (nothing is waited for). Sends still in flight
        and receives posted ahead stay referenced (a peer may be about to deliver one: dropping its
        buffer would lose it, or let it write into freed memory)."""
        self._poison.extend((work, x) for work, x, *_ in self._pending)
        for p in self._posted.values():
            self._poison.extend([(p.header_work, p.header), (p.payload_work, p.payload)])
        self._posted.clear()
        self._pending.clear()
        self._local.clear()
        self.held_bytes = 0

    # -- bookkeeping --------------------------------------------------------------------------
    def _isend(self, x: torch.Tensor, dst: int, tag: int, key: Any) -> None:
        self.sent_keys.add((dst, key))
        with _peer_lost(dst, "send to"):
            work = dist.isend(x, dst=dst, tag=tag)
        self._pending.append((work, x, dst, key))
        self.messages += 1
        self.held_bytes += x.numel() * x.element_size()
        self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes)

    def release(self, delivered: Callable[[int, Any], bool]) -> None:
        """Wait for (at once: they have arrived) and drop the sends whose `delivered(dst, key)`
        is true, so their buffers can be freed before the end of the step."""
        keep = []
        for entry in self._pending:
            work, x, dst, key = entry
            if key is not None and delivered(dst, key):
                with _peer_lost(dst, "send to"):
                    work.wait()
                self.held_bytes -= x.numel() * x.element_size()
            else:
                keep.append(entry)
        self._pending = keep

    def wait_sends(self) -> None:
        """Wait for every send issued so far (their buffers are released afterwards)."""
        for work, _, dst, _ in self._pending:
            with _peer_lost(dst, "send to"):
                work.wait()
        self._pending.clear()
        self.held_bytes = 0
        if self._local:  # pragma: no cover - an executor bug, not a user error
            leftover = sorted(self._local)
            self._local.clear()
            raise RuntimeError(f"pipeline: in-memory messages were never received (tags {leftover[:5]})")


@dataclass
class _Posted:
    """A message's receives: its header (or int) and, when a size is agreed, its payload's."""
    header: torch.Tensor
    header_work: Any
    payload: Optional[torch.Tensor]
    payload_work: Any
