"""nnscaler.runtime.sequence_loss.cross_entropy on real gloo processes: each rank holding 1/n of the
tokens, the loss and the gradient of its logits equal ``F.cross_entropy(reduction='mean')`` over all
tokens in one process (float64, 1e-12): class indices with ignored targets (one rank with every
target ignored), class weights, label smoothing, class probabilities, spatial dims; one all-reduce a
call, nothing of the logits' size sent. One launch of 2 ranks; the refusal of other reductions
needs no process, nor does the per-rank sum's memory (the logits themselves saved, nothing else
logits-sized) or a second backward through the same graph."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from launch import run_workers

N, C = 12, 7


def _problem(kind):
    g = torch.Generator().manual_seed(len(kind))
    x = torch.randn(N, C, dtype=torch.float64, generator=g)
    kw = {}
    if kind == "probabilities":
        t = torch.softmax(torch.randn(N, C, dtype=torch.float64, generator=g), -1)
    elif kind == "spatial":
        x = torch.randn(2, C, N, dtype=torch.float64, generator=g)
        t = torch.randint(0, C, (2, N), generator=g)
    else:
        t = torch.randint(0, C, (N,), generator=g)
        t[: N // 2] = -100  # rank 0's tokens all ignored
        t[N - 1] = -100
        if kind == "weight":
            kw["weight"] = torch.rand(C, dtype=torch.float64, generator=g) + 0.5
        if kind == "smoothing":
            kw["label_smoothing"] = 0.1
    return x, t, kw


def _job(rank, world, kinds):
    from nnscaler.runtime import sequence_loss
    from nnscaler.runtime.comm import count_collectives
    out = {}
    for kind in kinds:
        x, t, kw = _problem(kind)
        dim = 2 if kind == "spatial" else 0
        rows = slice(rank * x.shape[dim] // world, (rank + 1) * x.shape[dim] // world)
        mine = (x[:, :, rows] if dim == 2 else x[rows]).clone().requires_grad_(True)
        t_mine = t[:, rows] if dim == 2 else t[rows]
        with count_collectives() as stats:
            loss = sequence_loss.cross_entropy(mine, t_mine, ranks=(0, 1), **kw)
            loss.backward()
        full = x.clone().requires_grad_(True)
        want = F.cross_entropy(full, t, **kw)
        want.backward()
        grad = full.grad[:, :, rows] if dim == 2 else full.grad[rows]
        out[kind] = (abs(loss.item() - want.item()), (mine.grad - grad).abs().max().item(),
                     stats.calls("all_reduce"), stats.calls("all_gather"))
    return out


@pytest.mark.multiprocess
def test_split_mean_equals_one_process():
    kinds = ("ignored", "weight", "smoothing", "probabilities", "spatial")
    results = run_workers(_job, 2, kinds, timeout=120)
    for rank in (0, 1):
        for kind in kinds:
            loss_diff, grad_diff, all_reduces, all_gathers = results[rank][kind]
            assert loss_diff <= 1e-12 and grad_diff <= 1e-12, (rank, kind, loss_diff, grad_diff)
            assert (all_reduces, all_gathers) == (1, 0), (rank, kind, all_reduces, all_gathers)


def test_other_reductions_are_refused_by_name():
    from nnscaler.runtime import sequence_loss
    from nnscaler.runtime.comm import CommError
    with pytest.raises(CommError, match="reduction='mean' only .*reduction='sum'"):
        sequence_loss.cross_entropy(torch.randn(4, 3), torch.zeros(4, dtype=torch.long), reduction="sum", ranks=(0,))


@pytest.mark.parametrize("weighted", [False, True])
def test_sum_holds_one_logits_sized_tensor_and_equals_torch(weighted):
    """The fused per-rank sum (class indices, no smoothing) equals ``F.cross_entropy(reduction='sum')``
    in float64 (loss and gradient, ignored targets included) and saves no (N, C) tensor but the
    logits themselves (the model's output holds them anyway)."""
    from nnscaler.runtime import sequence_loss
    x, t, _ = _problem("ignored")
    w = torch.rand(C, dtype=torch.float64, generator=torch.Generator().manual_seed(3)) + 0.5 if weighted else None
    mine, ref = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    saved = []

    def pack(s):
        if s.shape == x.shape:
            saved.append(s)
        return s

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda s: s):
        loss = sequence_loss._sum(mine, t, w, -100, 0.0)
    want = F.cross_entropy(ref, t, weight=w, reduction="sum")
    loss.backward()
    want.backward()
    assert abs(loss.item() - want.item()) <= 1e-12
    assert (mine.grad - ref.grad).abs().max().item() <= 1e-12
    assert len(saved) == 1 and saved[0].data_ptr() == mine.data_ptr()  # the logits, not a copy of them


def test_sum_takes_a_second_backward_through_the_same_graph():
    """Nothing saved is modified: ``backward(retain_graph=True)`` then ``backward()`` accumulates the
    same gradient twice, for low precision too (float32 softmax)."""
    from nnscaler.runtime import sequence_loss
    for dtype in (torch.float64, torch.bfloat16):
        x, t, _ = _problem("ignored")
        x = x.to(dtype).requires_grad_(True)
        loss = sequence_loss._sum(x, t, None, -100, 0.0)
        loss.backward(retain_graph=True)
        first = x.grad.clone()
        loss.backward()
        assert torch.equal(x.grad, first + first)
        ref = x.detach().double().requires_grad_(True)
        F.cross_entropy(ref, t, reduction="sum").backward()
        assert ((first.double() - ref.grad).norm() / ref.grad.norm()).item() <= (1e-12 if dtype == torch.float64 else 1e-2)
