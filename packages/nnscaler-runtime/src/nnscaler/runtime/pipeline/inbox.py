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

The same knowledge tells a sender when a message it sent has been delivered, on any backend
(gloo's send handles cannot be polled): the peer receives message X in a known action of its
list, and sends what it sends afterwards; once this rank has received one of those later
messages, X has arrived and its buffer can be released (`acks_between`, `delivered`). So sends
are held about as long as the schedule keeps the micro-batch in flight, not to the end of the
step.
"""
from __future__ import annotations

from typing import Dict, Iterator, List, Optional, Tuple

from nnscaler.ir.contracts import PipelineMeta
from nnscaler.ir.schedules import Schedule

__all__ = ["Message", "sends_between", "acks_between", "OrderedInbox"]

Message = Tuple[str, int, int, int]  # ('F' | 'B', value id, consuming stage, micro-batch)


def _actions(schedule: Schedule, device: int, training: bool) -> list:
    return [a for a in schedule.actions(device) if training or a.kind == "F"]


def _sends(schedule: Schedule, meta: PipelineMeta, src: int, dst: int, training: bool) -> List[Tuple[Message, int]]:
    """(message, index of the sending action in `src`'s list) of what `src` sends to `dst`."""
    out: List[Tuple[Message, int]] = []
    for i, a in enumerate(_actions(schedule, src, training)):
        if a.kind == "F":
            for vid in meta.outputs[a.stage]:
                for t in meta.consumers[vid]:
                    if schedule.device_of(t, a.micro) == dst:
                        out.append((("F", vid, t, a.micro), i))
        else:
            for vid in meta.inputs[a.stage]:
                if not meta.is_int(vid) and schedule.device_of(meta.producer[vid], a.micro) == dst:
                    out.append((("B", vid, a.stage, a.micro), i))
    return out


def sends_between(schedule: Schedule, meta: PipelineMeta, src: int, dst: int, training: bool) -> List[Message]:
    """The messages pipeline device `src` sends to pipeline device `dst`, in send order."""
    return [msg for msg, _ in _sends(schedule, meta, src, dst, training)]


def acks_between(schedule: Schedule, meta: PipelineMeta, me: int, peer: int, training: bool) -> Dict[Message, int]:
    """For each message `me` sends to `peer`: the position, in what `peer` sends to `me`, of the
    first message `peer` sends in or after the action that receives it (an action receives before
    it sends). Receiving that message (or a later one) proves delivery. Messages after which
    `peer` sends nothing more to `me` are absent."""
    actions = {(a.kind, a.stage, a.micro): i for i, a in enumerate(_actions(schedule, peer, training))}
    back = [i for _, i in _sends(schedule, meta, peer, me, training)]  # sending action, ascending
    acks: Dict[Message, int] = {}
    for msg in sends_between(schedule, meta, me, peer, training):
        kind, vid, t, m = msg
        receiver = ("F", t, m) if kind == "F" else ("B", meta.producer[vid], m)
        k = next((k for k, i in enumerate(back) if i >= actions[receiver]), None)
        if k is not None:
            acks[msg] = k
    return acks


class OrderedInbox:
    """Per peer, the expected message sequence and a cursor; received messages wait in a dict."""

    def __init__(self, mailbox, sequences: Dict[int, List[Message]], tag_of, is_int,
                 acks: Optional[Dict[int, Dict[Message, int]]] = None):
        self.mailbox = mailbox
        self.sequences = sequences  # peer rank -> messages in send order
        self.tag_of, self.is_int = tag_of, is_int  # Message -> tag; value id -> sent as an int
        self.acks = acks or {}  # peer rank -> {message this rank sends it: position that proves delivery}
        self.position = {peer: {msg: i for i, msg in enumerate(seq)} for peer, seq in sequences.items()}
        self.cursor = {peer: 0 for peer in sequences}
        self.received = {peer: -1 for peer in sequences}  # position of the last message really received
        self.arrived: Dict[Tuple[int, Message], object] = {}
        self.grad_expected: Dict[Message, bool] = {}  # ('B', vid, t, m) -> will it come?

    def reset(self) -> None:
        if self.arrived:  # pragma: no cover - a schedule / executor bug
            raise RuntimeError(f"pipeline: messages received but never used: {sorted(self.arrived)[:5]}")
        self.cursor = {peer: 0 for peer in self.sequences}
        self.received = {peer: -1 for peer in self.sequences}
        self.grad_expected.clear()

    def delivered(self, peer: int, msg: Message) -> bool:
        """Whether `msg`, sent by this rank to `peer` this step, has certainly been received."""
        k = self.acks.get(peer, {}).get(msg)
        return k is not None and self.received.get(peer, -1) >= k

    def post(self, messages) -> None:
        """Post ahead the receives of `messages` ((peer, message) pairs) not read yet: a gradient
        only once it is known to come (mailbox.post: on a backend that matches by tag)."""
        for peer, msg in messages:
            pos = self.position.get(peer, {}).get(msg)
            if pos is None or pos < self.cursor[peer] or (msg[0] == "B" and not self.grad_expected.get(msg, False)):
                continue
            self.mailbox.post(peer, self.tag_of(msg), self.is_int(msg[1]))

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
            self.received[peer] = self.cursor[peer] - 1
            self.arrived[(peer, nxt)] = value
        if key not in self.arrived:
            raise RuntimeError(f"pipeline: rank expects {msg} from rank {peer}, which the schedule never sends")
        return self.arrived.pop(key)
