"""nnscaler.runtime.expert_groups (no process): the groups, replica sets and group expert ids of a unit
under ``ep_size`` k, and the packing of the stored experts around their one all-gather."""
from __future__ import annotations

import pytest
import torch

from nnscaler.runtime.comm import CommError
from nnscaler.runtime.expert_groups import expert_groups, gather_experts, group_expert_ids


def test_groups_are_consecutive_and_replica_sets_strided():
    ranks = (7, 3, 5, 1, 0, 2)  # piece order, not sorted
    shares = [expert_groups(ranks, 2, i) for i in range(6)]
    assert [s.group for s in shares] == [(7, 3), (7, 3), (5, 1), (5, 1), (0, 2), (0, 2)]
    assert [s.position for s in shares] == [0, 1] * 3 and [s.first for s in shares] == [0, 0, 2, 2, 4, 4]
    assert [s.replicas for s in shares] == [(7, 5, 0), (3, 1, 2)] * 3
    assert expert_groups(ranks, 3, 4).replicas == (3, 0) and expert_groups(ranks, 3, 4).group == (1, 0, 2)


@pytest.mark.parametrize("k", [0, 4, 2.0, True])
def test_bad_ep_size_is_refused(k):
    with pytest.raises(CommError, match=r"ep_size=.* must be a whole number dividing the 6 ranks"):
        expert_groups(tuple(range(6)), k, 0)


@pytest.mark.parametrize("experts, n, k", [(8, 4, 2), (12, 6, 2), (12, 6, 3), (24, 8, 4), (16, 8, 2)])
def test_group_ids_follow_the_gathered_order(experts, n, k):
    """Group position p gathers the stored experts of pieces p, p + k, ... in that order: its i-th
    gathered expert has group id p * E/k + i; dropped pairs (id E) stay E."""
    ids = group_expert_ids(experts, n, k)
    shard = experts // n
    for p in range(k):
        gathered = [e for j in range(n // k) for e in range((p + j * k) * shard, (p + j * k + 1) * shard)]
        assert ids[gathered].tolist() == [p * experts // k + i for i in range(experts // k)]
    assert sorted(ids.tolist()) == list(range(experts + 1)) and int(ids[-1]) == experts


def test_relabelled_routing_is_the_same_routing():
    """Sorting the pairs by group id and reading each group id's original expert gives, per expert, the
    same pairs as the original ids (the relabelling only renames experts)."""
    g = torch.Generator().manual_seed(0)
    index = torch.randint(0, 8, (20, 2), generator=g)
    ids = group_expert_ids(8, 4, 2)
    original_of = torch.argsort(ids[:-1])
    relabelled = ids[index]
    assert torch.equal(original_of[relabelled], index)
    assert torch.equal(torch.bincount(relabelled.reshape(-1), minlength=8)[ids[:-1]],
                       torch.bincount(index.reshape(-1), minlength=8))


def test_gather_packs_and_unpacks_every_weight():
    """With one replica (no communication) the weights come back as they were, with gradients, biases
    (None kept in place) included; weights of different dtypes are gathered one by one."""
    g = torch.Generator().manual_seed(1)
    up = torch.randn(3, 4, 5, generator=g, dtype=torch.float64, requires_grad=True)
    down = torch.randn(3, 5, 2, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(3, 2, generator=g, dtype=torch.float64, requires_grad=True)
    got = gather_experts((up, down, None, bias), (0,))
    assert got[2] is None and all(torch.equal(a, b) for a, b in zip(got[:2] + got[3:], (up, down, bias)))
    # views of one packed buffer, each starting and striding (per expert) on 16 bytes, in bfloat16 too
    for dtype in (torch.float64, torch.bfloat16):
        half = gather_experts(tuple(w.detach().to(dtype) for w in (up, down, bias)), (0,))
        size = half[0].element_size()
        assert len({w.untyped_storage().data_ptr() for w in half}) == 1
        assert all(w.storage_offset() * size % 16 == 0 and w.stride(0) * size % 16 == 0 and w[0].is_contiguous()
                   for w in half), [(w.storage_offset(), w.stride()) for w in half]
    sum((w * (i + 1)).sum() for i, w in enumerate(x for x in got if x is not None)).backward()
    assert all(torch.equal(w.grad, torch.full_like(w, i + 1)) for i, w in enumerate((up, down, bias)))
    mixed = gather_experts((up.detach().float(), down.detach()), (0,))
    assert [w.dtype for w in mixed] == [torch.float32, torch.float64]
