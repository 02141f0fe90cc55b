"""Adapters: `transition_steps` tables, `steps_cost`, and every transition run for real on gloo.

The multi-process tests run every (src, dst) pair of {R, V, D(0), D(1), D(2), D(-1)} x
{R, R*, V, D(0), D(1), D(2), D(-2)} on a 3-D tensor through `nnscaler.runtime.comm`, forward and
backward, in one spawned job for n=2 (sorted ranks, reversed ranks, forced fallbacks) and one
for n=4 (sorted ranks, permuted ranks, two 2-rank sub-groups); the parent checks the pieces,
the gradients (the invariant of `nnscaler.runtime.comm.collectives`) and the counted
collectives against `step_collectives` / `steps_cost`.
"""
from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from launch import run_workers  # noqa: E402

from nnscaler.codegen.adapters import (  # noqa: E402
    STEP_COLLECTIVES, CommCost, step_collectives, steps_cost, transition_steps)
from nnscaler.ir.layout import Partial, Replicate, Shard, TensorLayout  # noqa: E402

SHAPE = (4, 8, 12)  # every dim divisible by 2 and 4
SRCS = ["R", "V", "D0", "D1", "D2", "D-1"]
DSTS = ["R", "R*", "V", "D0", "D1", "D2", "D-2"]


def placement(name: str):
    """'R' / 'R*' / 'V' / 'D<dim>' -> (placement, grad_partial)."""
    if name in ("R", "R*"):
        return Replicate(), name == "R*"
    if name == "V":
        return Partial(), False
    return Shard(int(name[1:])), False


def _norm(name: str) -> str:
    return f"D{int(name[1:]) % len(SHAPE)}" if name.startswith("D") else name


def steps_for(src: str, dst: str):
    s, _ = placement(src)
    d, gp = placement(dst)
    return transition_steps(s, d, grad_partial=gp, ndim=len(SHAPE))


# -- pure tests -----------------------------------------------------------------------------------
R, V = Replicate(), Partial()


@pytest.mark.parametrize("src, dst, gp, expected", [
    (R, R, False, []),
    (V, V, False, []),
    (Shard(1), Shard(1), False, []),
    (R, R, True, [("grad_all_reduce", {})]),
    (R, V, False, [("to_partial", {})]),
    (R, Shard(2), False, [("split", {"dim": 2})]),
    (V, R, False, [("all_reduce", {})]),
    (V, R, True, [("all_reduce_ar", {})]),
    (V, Shard(0), False, [("reduce_scatter", {"dim": 0})]),
    (Shard(1), R, False, [("all_gather", {"dim": 1})]),
    (Shard(1), R, True, [("all_gather_rs", {"dim": 1})]),
    (Shard(1), V, False, [("shard_to_partial", {"dim": 1})]),
    (Shard(0), Shard(2), False, [("all_to_all", {"src_dim": 0, "dst_dim": 2})]),
])
def test_transition_table(src, dst, gp, expected):
    assert transition_steps(src, dst, grad_partial=gp) == expected


def test_every_pair_is_one_known_step_or_none():
    for src in SRCS:
        for dst in DSTS:
            steps = steps_for(src, dst)
            same = _norm(src) == _norm(dst)
            assert (steps == []) == same, (src, dst, steps)
            assert len(steps) <= 1 and all(name in STEP_COLLECTIVES for name, _ in steps)


def test_negative_dims_and_tensor_layouts():
    assert transition_steps(Shard(-1), Shard(2), ndim=3) == []
    assert transition_steps(Shard(-1), R, ndim=3) == [("all_gather", {"dim": 2})]
    src = TensorLayout(SHAPE, Shard(-1), 2, 0)  # TensorLayout normalises to D(2) itself
    assert transition_steps(src, TensorLayout(SHAPE, Shard(0), 2, 0)) == [
        ("all_to_all", {"src_dim": 2, "dst_dim": 0})]
    assert transition_steps(Shard(-3), Shard(0), ndim=3) == []
    with pytest.raises(ValueError, match="out of range"):
        transition_steps(Shard(3), R, ndim=3)
    # without ndim dims are compared as written (the runtime makes equal dims the identity)
    assert transition_steps(Shard(-1), Shard(2)) == [("all_to_all", {"src_dim": -1, "dst_dim": 2})]


def test_bad_arguments():
    with pytest.raises(ValueError, match="grad_partial applies to a replicated destination"):
        transition_steps(R, Shard(0), grad_partial=True)
    with pytest.raises(TypeError, match="must be a placement"):
        transition_steps("R", R)
    assert transition_steps(V, R, n=1) == []


def test_steps_cost():
    b, n = 1200, 4
    assert steps_cost([], b, n) == CommCost(0.0, 0.0)
    assert steps_cost([("all_reduce", {})], b, n) == CommCost(2 * 3 / 4 * b, 0.0)
    assert steps_cost([("split", {"dim": 0})], b, n) == CommCost(0.0, 3 / 4 * b)
    assert steps_cost([("all_gather_rs", {"dim": 0})], b, n).total == 2 * 3 / 4 * b
    assert steps_cost([("all_to_all", {"src_dim": 0, "dst_dim": 1})], b, n) == CommCost(3 / 16 * b, 3 / 16 * b)
    assert steps_cost([("reduce_scatter", {"dim": 0})], b, n, model="payload") == CommCost(b, b / n)
    assert steps_cost([("all_reduce_ar", {})], b, 1) == CommCost(0.0, 0.0)
    with pytest.raises(ValueError, match="unknown cost model"):
        steps_cost([], b, n, model="tree")
    assert step_collectives([("split", {"dim": 0}), ("reduce_scatter", {"dim": 1})]) == (
        ["reduce_scatter"], ["all_gather", "all_gather"])


def test_each_step_is_the_cheapest():
    """No two-step route through R or V moves fewer bytes (fwd + bwd) than the chosen step."""
    b, n = 960.0, 4
    for src in SRCS:
        for dst in DSTS:
            best = steps_cost(steps_for(src, dst), b, n).total
            for mid in ("R", "V", "D0", "D1", "D2"):
                route = steps_for(src, mid) + steps_for(mid, dst)
                assert best <= steps_cost(route, b, n).total + 1e-9, (src, dst, mid)


# -- multi-process: every transition, forward and backward ---------------------------------------
def _pieces(full: torch.Tensor, n: int, seed: int):
    """n deterministic random pieces summing to `full`."""
    g = torch.Generator().manual_seed(seed)
    parts = [torch.randn(full.shape, generator=g, dtype=full.dtype) for _ in range(n - 1)]
    return parts + [full - sum(parts)] if parts else [full.clone()]


def _full(seed: int):
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _local(name: str, full: torch.Tensor, k: int, n: int, seed: int) -> torch.Tensor:
    """Piece k of `full` under layout `name` ('R*' and 'V' pieces: random partials)."""
    if name == "R":
        return full.clone()
    if name in ("V", "R*"):
        return _pieces(full, n, seed)[k]
    return full.chunk(n, int(name[1:]))[k].clone()


def _variants(world: int):
    """(variant name, ranks for each rank, force fallbacks)."""
    if world == 2:
        return [("sorted", [(0, 1)] * 2, False), ("reversed", [(1, 0)] * 2, False),
                ("fallback", [(0, 1)] * 2, True)]
    return [("sorted", [(0, 1, 2, 3)] * 4, False), ("permuted", [(2, 0, 3, 1)] * 4, False),
            ("pairs", [(1, 0), (1, 0), (3, 2), (3, 2)], False)]


def _transitions_job(rank: int, world: int):
    import nnscaler.runtime.comm as comm
    from nnscaler.runtime.comm import count_collectives, force_fallback

    out = {}
    x, g = _full(0), _full(1)
    if world == 4:
        # (a runtime check that needs 4 ranks, kept here to spare a spawn) a sub-group that was
        # never created is refused on its members instead of being created lazily (a hang)
        try:
            comm.all_reduce(x, ranks=(0, 1) if rank < 2 else (2, 3))
        except comm.CommError as e:
            out["missing group"] = str(e)
        # creating a group is collective: every rank, same order
        comm.group_for((0, 1))
        comm.group_for((2, 3))
    for variant, ranks_of, fallback in _variants(world):
        ranks = ranks_of[rank]
        n, k = len(ranks), ranks.index(rank)
        with force_fallback() if fallback else contextlib.nullcontext():
            for src in SRCS:
                for dst in DSTS:
                    xin = _local(src, x, k, n, seed=10).requires_grad_()
                    with count_collectives() as fwd:
                        y = xin
                        for name, kwargs in steps_for(src, dst):
                            y = getattr(comm, name)(y, **kwargs, ranks=ranks)
                    grad = _local(dst if dst != "V" else "R", g, k, n, seed=20)
                    with count_collectives() as bwd:
                        y.backward(grad)
                    out[variant, src, dst] = (k, n, y.detach(), y.is_contiguous(), xin.grad,
                                              fwd.snapshot(), bwd.snapshot())
    if world == 4:  # groups destroyed under the comm package's cache are not used again
        from nnscaler.runtime.grid import RankGrid
        RankGrid.destroy_all()
        try:
            comm.all_reduce(x, ranks=(1, 0) if rank < 2 else (3, 2))
        except comm.CommError as e:
            out["destroyed group"] = str(e)
    return out


def _expected_counts(steps, fallback: bool):
    fwd, bwd = step_collectives(steps)

    def count(names):
        res = {}
        for c in names:
            key = f"{c}(fallback)" if fallback and c != "all_reduce" else c
            res[key] = res.get(key, 0) + 1
        return res
    return count(fwd), count(bwd)


def _check(results, world):
    x, g = _full(0), _full(1)
    nbytes = x.numel() * x.element_size()
    checked = 0
    for variant, ranks_of, fallback in _variants(world):
        for src in SRCS:
            for dst in DSTS:
                steps = steps_for(src, dst)
                groups = sorted(set(ranks_of))
                for ranks in groups:
                    outs = {}
                    for rank in ranks:
                        k, n, y, contiguous, xgrad, fwd, bwd = results[rank][variant, src, dst]
                        where = f"{variant} {src}->{dst} rank {rank} (piece {k}/{n})"
                        assert k == ranks.index(rank) and n == len(ranks)
                        outs[k] = y
                        # forward piece
                        if dst in ("R", "R*"):
                            torch.testing.assert_close(y, x, msg=where)
                        elif dst != "V":
                            torch.testing.assert_close(y, x.chunk(n, int(dst[1:]))[k], msg=where)
                        if steps:
                            assert contiguous, where
                        # backward: the src-local gradient per the invariant
                        want = g if src in ("R", "V") else g.chunk(n, int(src[1:]))[k]
                        torch.testing.assert_close(xgrad, want, msg=where)
                        # counted collectives
                        want_f, want_b = _expected_counts(steps, fallback)
                        assert {c: v["calls"] for c, v in fwd.items()} == want_f, (where, fwd)
                        assert {c: v["calls"] for c, v in bwd.items()} == want_b, (where, bwd)
                        cost = steps_cost(steps, nbytes, n, model="payload")
                        assert sum(v["bytes"] for v in fwd.values()) == cost.forward, (where, fwd)
                        assert sum(v["bytes"] for v in bwd.values()) == cost.backward, (where, bwd)
                        checked += 1
                    if dst == "V":
                        torch.testing.assert_close(sum(outs.values()), x, msg=f"{variant} {src}->V")
    return checked


def _named_counts(results, variant, src, dst):
    _, _, _, _, _, fwd, bwd = results[0][variant, src, dst]
    return ({c: v["calls"] for c, v in fwd.items()}, {c: v["calls"] for c, v in bwd.items()})


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 4])
def test_all_transitions(world):
    results = run_workers(_transitions_job, world, timeout=120)
    if world == 4:
        for rank, res in enumerate(results):
            pair = (0, 1) if rank < 2 else (2, 3)
            assert f"no process group exists yet for ranks {pair}" in res.pop("missing group")
            assert f"no process group exists yet for ranks {pair}" in res.pop("destroyed group")
    assert _check(results, world) == len(_variants(world)) * len(SRCS) * len(DSTS) * world
    # spelled out, independently of STEP_COLLECTIVES
    assert _named_counts(results, "sorted", "R", "D1") == ({}, {"all_gather": 1})
    assert _named_counts(results, "sorted", "D1", "R") == ({"all_gather": 1}, {})
    assert _named_counts(results, "sorted", "V", "R") == ({"all_reduce": 1}, {})
    assert _named_counts(results, "sorted", "R", "R*") == ({}, {"all_reduce": 1})
    assert _named_counts(results, "sorted", "D0", "R*") == ({"all_gather": 1}, {"reduce_scatter": 1})
    assert _named_counts(results, "sorted", "V", "D2") == ({"reduce_scatter": 1}, {"all_gather": 1})
    assert _named_counts(results, "sorted", "D0", "D2") == ({"all_to_all": 1}, {"all_to_all": 1})
    assert _named_counts(results, "sorted", "V", "R*") == ({"all_reduce": 1}, {"all_reduce": 1})
    for same in [("R", "R"), ("V", "V"), ("D1", "D1"), ("D-1", "D2"), ("D1", "D-2")]:
        assert _named_counts(results, "sorted", *same) == ({}, {})
    if world == 2:
        assert _named_counts(results, "fallback", "V", "D2") == (
            {"reduce_scatter(fallback)": 1}, {"all_gather(fallback)": 1})
