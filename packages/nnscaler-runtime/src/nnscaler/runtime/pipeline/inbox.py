"""Receive pipeline messages in the order their sender sent them.

NCCL matches point-to-point messages between two ranks in issue order and ignores tags; gloo
honours tags. To be right on both, a receiver never asks for "the message with tag X" out of
order: it knows the schedule (identical on every rank), so it knows the exact sequence of
messages each peer sends it -- walking the peer's action list: ``F(s, m)`` sends each output of
stage ``s`` to every consuming stage, ``B(t, m)`` sends back the gradient of each input of stage
``t`` that required one. It reads that sequence from the front, keeping messages that arrive
before the one it needs, until the one it needs has arrived.

Whether a gradient comes back is known to the receiver: it is the producer of that value, and
the consumer returns a gradient exactly when the producer's tensor required one (the flag
travels in the forward message's header).
"""
from __future__ import annotations

from typing import Dict, Iterator, List, Tuple

from nnscaler.ir.schedules import Schedule

__all__ = ["Message", "sends_between", "OrderedInbox"]

Message = Tuple[str, int, int, int]  # ('F' | 'B', value id, consuming stage, micro-batch)


def sends_between(schedule: Schedule, meta: dict, src: int, dst: int, training: bool) -> List[Message]:
    """The messages pipeline device `src` sends to pipeline device `dst`, in send order."""
    out: List[Message] = []
    for a in schedule.actions(src):
        if a.kind == "F":
            for vid in meta["outputs"][a.stage]:
                for t in meta["consumers"][vid]:
                    if schedule.device_of(t, a.micro) == dst:
                        out.append(("F", vid, t, a.micro))
        elif training:
            for vid in meta["inputs"][a.stage]:
                if meta["kinds"][vid] == "tensor" and schedule.device_of(meta["producer"][vid], a.micro) == dst:
                    out.append(("B", vid, a.stage, a.micro))
    return out


class OrderedInbox:
    """Per peer, the expected message sequence and a cursor; received messages wait in a dict."""

    def __init__(self, mailbox, sequences: Dict[int, List[Message]], tag_of, is_int):
        self.mailbox = mailbox
        self.sequences = sequences  # peer rank -> messages in send order
        self.tag_of, self.is_int = tag_of, is_int  # Message -> tag; value id -> sent as an int
        self.cursor = {peer: 0 for peer in sequences}
        self.arrived: Dict[Tuple[int, Message], object] = {}
        self.grad_expected: Dict[Message, bool] = {}  # ('B', vid, t, m) -> will it come?

    def reset(self) -> None:
        if self.arrived:  # pragma: no cover - a schedule / executor bug
            raise RuntimeError(f"pipeline: messages received but never used: {sorted(self.arrived)[:5]}")
        self.cursor = {peer: 0 for peer in self.sequences}
        self.grad_expected.clear()

    def _pending(self, peer: int) -> Iterator[Message]:
        seq = self.sequences[peer]
        while self.cursor[peer] < len(seq):
            yield seq[self.cursor[peer]]

    def recv(self, peer: int, msg: Message):
        """The payload of `msg` from `peer` (a tensor, or an int)."""
        key = (peer, msg)
        for nxt in self._pending(peer):
            if key in self.arrived:
                break
            self.cursor[peer] += 1
            if nxt[0] == "B" and not self.grad_expected.get(nxt, False):
                continue  # the sender sends no gradient for a value that needed none
            tag = self.tag_of(nxt)
            value = (self.mailbox.recv_int(peer, tag) if self.is_int(nxt[1])
                     else self.mailbox.recv_tensor(peer, tag))
            self.arrived[(peer, nxt)] = value
        if key not in self.arrived:
            raise RuntimeError(f"pipeline: rank expects {msg} from rank {peer}, which the schedule never sends")
        return self.arrived.pop(key)
