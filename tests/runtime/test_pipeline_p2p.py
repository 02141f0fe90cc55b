"""Pipeline messages on 2 real gloo ranks (runtime/pipeline/p2p.py): tensors of every kind
arrive intact with and without receives posted ahead, in the first step (no agreed size), in
later steps (the agreed size) and when a shape grows or shrinks; ints; a sender finishes its
sends before the receiver reads once the receives are posted ahead; a failure notice reaches a
receive posted ahead."""
from __future__ import annotations

import pytest
import torch

from launch import run_workers

pytestmark = pytest.mark.multiprocess


def _tensors(step: int):
    """What rank 0 sends in `step`: steps 1 and 2 alike, step 3 with grown and shrunk shapes."""
    g = torch.Generator().manual_seed(step)
    grow = 3 if step == 3 else 0
    return [torch.randn(4 + grow, 5, generator=g).requires_grad_(True),
            torch.randn((), generator=g, dtype=torch.float64),
            torch.zeros(0, 3),
            torch.randint(0, 2, (7 - 2 * (step == 3),), generator=g).bool(),
            torch.randn(2, 3 + grow, generator=g, dtype=torch.complex128),
            torch.randn(3, 6, generator=g).to(torch.bfloat16)[:, ::2]]  # not contiguous


def _exchange(rank, world, post_ahead):
    import torch.distributed as dist
    from nnscaler.runtime.pipeline.p2p import Mailbox, PeerFailure
    box = Mailbox(rank, torch.device("cpu"), post_ahead=post_ahead)
    out = {"got": {}, "messages": {}}
    for step in (1, 2, 3):
        box.new_step()
        sent = _tensors(step)
        tags = list(range(10, 10 + len(sent)))
        if rank == 1:
            for tag in tags:
                box.post(0, tag)
            box.post(0, 99, is_int=True)
        dist.barrier()
        if rank == 0:
            before = box.messages
            for tag, x in zip(tags, sent):
                box.send_tensor(x, 1, tag)
            box.send_int(41 + step, 1, 99)
            # posted ahead with an agreed size, every send is written before the receiver
            # reads: waiting for them here, before the barrier rank 1 reads after, cannot hang
            if post_ahead and step == 2:
                box.wait_sends()
            out["messages"][step] = box.messages - before
        if step == 2:
            dist.barrier()
        if rank == 1:
            got = [box.recv_tensor(0, tag) for tag in tags]
            out["got"][step] = [(t.clone(), t.requires_grad) for t in got] + [box.recv_int(0, 99)]
        box.wait_sends()
        dist.barrier()
    # a failure notice in place of a message whose receive (header and agreed payload) is posted
    box.new_step()
    if rank == 1:
        box.post(0, 10)
    dist.barrier()
    if rank == 0:
        box.send_poison(1, 10, False, stage=3, micro=2)
    else:
        try:
            box.recv_tensor(0, 10)
            out["failure"] = None
        except PeerFailure as exc:
            out["failure"] = str(exc)
        box.abandon()
    dist.barrier()
    return out


@pytest.mark.parametrize("post_ahead", [True, False])
def test_messages_arrive_intact(post_ahead):
    sender, receiver = run_workers(_exchange, 2, post_ahead, timeout=120)
    for step in (1, 2, 3):
        expected = _tensors(step)
        got = receiver["got"][step]
        for x, (y, requires_grad) in zip(expected, got[:-1]):
            assert y.dtype == x.dtype and y.shape == x.shape
            assert torch.equal(y, x.detach())
            assert requires_grad == x.requires_grad
        assert got[-1] == 41 + step
    # a tensor: header + payload; with an agreed size (step 2) the payload under the agreed tag
    # only; a changed shape (step 3) pads the agreed payload and sends its bytes again
    n = len(_tensors(1))
    assert sender["messages"][1] == 2 * n + 1
    assert sender["messages"][2] == 2 * n + 1
    changed = sum(a.shape != b.shape for a, b in zip(_tensors(2), _tensors(3)))
    assert changed == 3
    assert sender["messages"][3] == 2 * n + 1 + (changed if post_ahead else 0)
    assert "pipeline rank 0 failed in stage 3, micro-batch 2" in receiver["failure"]
