"""nnscaler.runtime.moe.expert_parallel on real gloo processes: on n ranks, each holding 1/n of the
tokens and of the experts, the outputs and every gradient (tokens, routing weights, expert
weights and biases) equal `routed_experts` on the whole batch in one process (float64, 1e-12);
the native all-to-all with variable counts and its all-gather fallback alike, with ranks in any
order, an expert that receives no token, a rank that sends none, and ranks whose experts receive
no row at all (their backward still runs the exchanges: no hang), and with a capacity factor (the
pairs dropped are those one process drops on the whole batch); the payload counted is the
rows exchanged; `expert_load` records the tokens per expert of the unit, the rank's own tokens' and,
with a capacity, the pairs the rank's tokens lost (summed over the ranks: one process's). With
``ep_size`` 2 of 4 ranks (each rank storing 1/4 of the experts, the tokens exchanged inside groups of 2,
ranks in order or not, with a capacity) the same holds, with one all-gather of the experts forward and
one reduce-scatter of their gradients backward. One launch of 4 ranks runs every case."""
from __future__ import annotations

import pytest
import torch

from launch import run_workers

TOKENS, HIDDEN, FFN, EXPERTS, K = 12, 6, 5, 4, 2


def _problem(seed, skewed=False):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(TOKENS, HIDDEN, generator=g, dtype=torch.float64)
    index = torch.stack([torch.randperm(EXPERTS, generator=g)[:K] for _ in range(TOKENS)])
    if skewed == "first":  # every token to experts 0 and 1: the ranks holding the others receive no row
        index = torch.stack([torch.randperm(2, generator=g) for _ in range(TOKENS)])
    elif skewed:  # expert 3 gets nothing; the first tokens all go to experts 0 and 1
        index = torch.where(index == 3, torch.zeros_like(index), index)
        index[:, 1] = torch.where(index[:, 0] == index[:, 1], (index[:, 0] + 1) % 3, index[:, 1])
    weights = torch.rand(TOKENS, K, generator=g, dtype=torch.float64)
    up = torch.randn(EXPERTS, 2 * FFN, HIDDEN, generator=g, dtype=torch.float64) * 0.3
    down = torch.randn(EXPERTS, HIDDEN, FFN, generator=g, dtype=torch.float64) * 0.3
    up_bias = torch.randn(EXPERTS, 2 * FFN, generator=g, dtype=torch.float64)
    down_bias = torch.randn(EXPERTS, HIDDEN, generator=g, dtype=torch.float64)
    return hidden, index, weights, up, down, up_bias, down_bias


SEED_OF_OUT = torch.linspace(-1, 1, TOKENS * HIDDEN, dtype=torch.float64).view(TOKENS, HIDDEN)


def _grads(fn, out_weight, hidden, index, weights, up, down, up_bias, down_bias):
    leaves = [t.clone().requires_grad_(True) for t in (hidden, weights, up, down, up_bias, down_bias)]
    h, w, u, d, ub, db = leaves
    out = fn(h, index, w, u, d, ub, db)
    (out * out_weight).sum().backward()
    return out.detach(), [t.grad for t in leaves]


def _job(rank, world, cases):
    import torch.distributed as dist
    from nnscaler.ir.ops.moe import routed_experts
    from nnscaler.runtime import comm, moe
    from nnscaler.runtime.comm import group_for
    out = {}
    for label, ranks, seed, skewed, fallback, *extra in cases:
        cf, ep = (extra + [None, None])[:2]
        group_for(sorted(ranks))
        if ep:  # the groups of `ep` ranks and the replica sets, on every rank in the same order
            for i in range(0, len(ranks), ep):
                group_for(sorted(ranks[i:i + ep]))
            for i in range(ep):
                group_for(sorted(ranks[i::ep]))
        if rank not in ranks:
            continue
        n, piece = len(ranks), ranks.index(rank)
        problem = _problem(seed, skewed)
        tok = slice(piece * TOKENS // n, (piece + 1) * TOKENS // n)
        exp = slice(piece * EXPERTS // n, (piece + 1) * EXPERTS // n)
        hidden, index, weights, up, down, up_bias, down_bias = problem
        moe.expert_load().reset()

        def parallel(h, i, w, u, d, ub, db):
            return moe.expert_parallel(h, i, w, u, d, ub, db, gate="clamped_swiglu", transposed=False, alpha=1.7,
                                       limit=2.0, capacity_factor=cf, ranks=ranks, ep_size=ep)
        with (comm.force_fallback("all_to_all") if fallback else _nothing()), comm.count_collectives() as stats:
            got, grads = _grads(parallel, SEED_OF_OUT[tok], hidden[tok], index[tok], weights[tok], up[exp], down[exp], up_bias[exp],
                                down_bias[exp])
        want, want_grads = _grads(lambda h, i, w, u, d, ub, db: routed_experts(
            h, i, w, u, d, ub, db, gate="clamped_swiglu", alpha=1.7, limit=2.0, capacity_factor=cf), SEED_OF_OUT,
            *problem)
        pieces = [want[tok], want_grads[0][tok], want_grads[1][tok], want_grads[2][exp], want_grads[3][exp],
                  want_grads[4][exp], want_grads[5][exp]]
        diffs = [(a - b).abs().max().item() for a, b in zip([got] + grads, pieces)]
        name = "all_to_all(fallback)" if fallback else "all_to_all"
        load = moe.expert_load()
        out[label] = (diffs, stats.calls(name), stats.bytes(name), load.per_call[0].tolist(),
                      torch.bincount(index.reshape(-1), minlength=EXPERTS).tolist(), list(load.own.values())[0].tolist(),
                      torch.bincount(index[tok].reshape(-1), minlength=EXPERTS).tolist(), list(load.dropped.values()),
                      [sum(stats.calls(f"{kind}{how}") for how in ("", "(fallback)"))
                       for kind in ("all_gather", "reduce_scatter")])
    dist.barrier()
    return out


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


CASES = [("native", (0, 1, 2, 3), 1, False, False), ("fallback", (0, 1, 2, 3), 2, False, True),
         ("reordered-pair", (3, 1), 3, True, False), ("pair-fallback", (0, 2), 4, True, True),
         # ranks whose experts receive no row still run the backward's exchanges (no hang)
         ("empty-ranks", (0, 1, 2, 3), 5, "first", False), ("empty-rank-pair", (1, 0), 6, "first", True),
         # a capacity: the pairs dropped are those one process drops on the whole batch
         ("capacity", (0, 1, 2, 3), 8, False, False, 0.75), ("capacity-skewed", (0, 1, 2, 3), 9, "first", False, 1.0),
         ("capacity-pair", (2, 0), 10, True, True, 0.5),
         # ep_size 2 of 4: each rank stores 1/4 of the experts, tokens exchanged inside groups of 2
         ("ep-size-2", (0, 1, 2, 3), 11, False, False, None, 2),
         ("ep-size-2-reordered", (3, 1, 0, 2), 12, True, True, None, 2),
         ("ep-size-2-capacity", (0, 1, 2, 3), 13, "first", False, 0.75, 2)]


@pytest.mark.multiprocess
def test_expert_parallel_equals_one_process():
    results = run_workers(_job, 4, CASES, timeout=120)
    from nnscaler.ir.ops.moe import routed_experts
    for label, ranks, seed, skewed, _, *extra in CASES:
        capacity = [c for c in extra[:1] if c is not None]
        if capacity:  # the capacity drops pairs (the output differs from dropless routing)
            problem = _problem(seed, skewed)
            assert not torch.equal(routed_experts(*problem, capacity_factor=capacity[0]), routed_experts(*problem)), label
        dropped = []
        for rank in ranks:
            diffs, calls, nbytes, load, want_load, own, want_own, rank_dropped, gathers = results[rank][label]
            assert max(diffs) <= 1e-12, (label, rank, diffs)
            assert calls == 4, (label, calls)  # dispatch and combine, forward and backward (inside the group)
            assert nbytes > 0 and load == want_load, (label, load, want_load)
            assert own == want_own, (label, rank, own, want_own)  # this rank's own tokens' choices
            # ep_size: one all-gather of the stored experts (forward), one reduce-scatter (backward)
            assert gathers == ([1, 1] if extra[1:] else [0, 0]), (label, rank, gathers)
            dropped += rank_dropped
        if capacity:  # the ranks' dropped pairs add up to those one process drops
            from nnscaler.ir.ops.moe import expert_capacity, kept_counts, slot_counts
            index = _problem(seed, skewed)[1]
            kept = kept_counts(slot_counts(index, EXPERTS).unsqueeze(0), expert_capacity(TOKENS, K, EXPERTS, capacity[0]))
            assert len(dropped) == len(ranks) and sum(dropped) == TOKENS * K - int(kept.sum()) > 0, (label, dropped)
        else:
            assert dropped == [], label


# -- the expert-load record (no process: a one-rank group) --------------------------------------
from launch import world1  # noqa: E402,F401  (fixture)


def test_expert_load_is_per_step_and_bounded():
    from nnscaler.runtime.moe import ExpertLoad
    load = ExpertLoad()
    for step in range(100):
        for micro in range(3):
            for layer in ("layers.0.experts", "layers.1.experts"):
                load.add(torch.tensor([2.0, 0.0, 1.0, 1.0]) * (step + 1), layer)
        assert list(load.per_layer) == ["layers.0.experts", "layers.1.experts"]  # one entry per layer
        assert load.per_layer["layers.1.experts"].tolist() == [6.0 * (step + 1), 0.0, 3.0 * (step + 1), 3.0 * (step + 1)]
        load.end_step()
        assert len(load.per_call) == 2  # the ended step is kept until the next step's first forward
    assert load.imbalance() == 2.0  # max 6 over mean 3
    load.add(torch.tensor([1.0, 1.0, 1.0, 1.0]))
    load.add(torch.tensor([1.0, 1.0, 1.0, 1.0]))  # calls without a layer: one entry each, in order
    assert list(load.per_layer) == ["call 0", "call 1"] and load.imbalance() == 1.0
    load.reset()
    assert load.per_call == [] and load.imbalance() == 1.0


def test_expert_load_counts_training_forwards_once(world1):
    """Recomputation in backward runs the forward again (collectives included) but is not counted
    twice; a forward without autograd (evaluation) is not counted."""
    from torch.utils.checkpoint import checkpoint
    from nnscaler.runtime import moe
    hidden, index, weights, up, down, *_ = _problem(7)
    up.requires_grad_(True)
    want = torch.bincount(index.reshape(-1), minlength=EXPERTS).tolist()

    def run(h):
        return moe.expert_parallel(h, index, weights, up, down, ranks=(0,), layer="moe")
    moe.expert_load().reset()
    with torch.no_grad():
        run(hidden)
    assert moe.expert_load().per_call == []
    checkpoint(run, hidden.requires_grad_(True), use_reentrant=False).sum().backward()
    assert moe.expert_load().per_layer["moe"].tolist() == want and up.grad is not None
    moe.expert_load().reset()


def test_balance_experts_refuses_bad_input():
    from nnscaler.runtime.moe import balance_experts
    for bad in (-0.1, "0.001", True, None):
        with pytest.raises(ValueError, match=r"load_balance_coeff must be a number >= 0 .* got"):
            balance_experts(torch.nn.Linear(2, 2), bad)
    with pytest.raises(TypeError, match=r"Linear is not a ParallelModule: call it on what parallelize returned"):
        balance_experts(torch.nn.Linear(2, 2), 1e-3)
