"""nnscaler.runtime.comm: the layout-transition collectives, their stats and gloo fallbacks.

Every transition pair, forward and backward, on 2 and 4 ranks is in tests/codegen/test_adapters.py;
here each function is checked on its own (values, gradients, contiguity, dtypes, counted bytes),
plus what needs no process group at all.
"""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

from launch import run_workers, world1  # noqa: F401  (fixtures)
import nnscaler.runtime.comm as comm
from nnscaler.ir.layout import LayoutError
from nnscaler.runtime.comm import fallbacks
from nnscaler.runtime.errors import NnScalerError


ONE_ARG = ["all_reduce", "to_partial", "grad_all_reduce", "all_reduce_ar"]
DIM_ARG = ["split", "all_gather", "reduce_scatter", "shard_to_partial", "all_gather_rs"]


def _call(name, x, ranks, dim=1):
    fn = getattr(comm, name)
    if name in ONE_ARG:
        return fn(x, ranks=ranks)
    if name == "all_to_all":
        return fn(x, src_dim=0, dst_dim=dim, ranks=ranks)
    return fn(x, dim=dim, ranks=ranks)


@pytest.fixture(autouse=True)
def clean_stats():
    yield
    comm.disable_stats()
    comm.reset_stats()


# -- no process group -----------------------------------------------------------------------------
@pytest.mark.parametrize("name", ONE_ARG + DIM_ARG + ["all_to_all"])
def test_single_rank_is_identity_without_a_group(name):
    x = torch.randn(4, 6, requires_grad=True)
    comm.enable_stats()
    assert _call(name, x, (0,)) is x
    assert _call(name, x, [0], dim=-1) is x
    assert comm.stats_snapshot() == {}


@pytest.mark.parametrize("name", ONE_ARG + DIM_ARG + ["all_to_all"])
def test_more_ranks_need_a_process_group(name):
    with pytest.raises(comm.CommError, match=rf"comm.{name} over ranks \(0, 1\) needs torch.distributed"):
        _call(name, torch.randn(4, 6), (0, 1))


@pytest.mark.parametrize("name, dim", [("split", 1), ("reduce_scatter", 1), ("all_to_all", 1),
                                       ("split", -1)])
def test_uneven_size_names_dim_size_and_n(name, dim):
    x = torch.randn(4, 5)
    with pytest.raises(comm.UnevenSplitError) as info:
        _call(name, x, (0, 1), dim=dim)
    msg = str(info.value)
    assert "dim 1 of size 5" in msg and "n=2 ranks" in msg and "(4, 5)" in msg, msg
    assert isinstance(info.value, LayoutError) and isinstance(info.value, NnScalerError)


def test_bad_arguments():
    x = torch.randn(4, 6)
    with pytest.raises(comm.CommError, match="dim=2 is out of range for a 2-dimensional tensor"):
        comm.split(x, 2, (0,))
    with pytest.raises(comm.CommError, match="dst_dim=-3 is out of range"):
        comm.all_to_all(x, 0, -3, (0, 1))
    with pytest.raises(comm.CommError, match="name a rank twice"):
        comm.all_reduce(x, (0, 0))
    with pytest.raises(comm.CommError, match="tuple of runtime ranks"):
        comm.all_reduce(x, 0)
    with pytest.raises(comm.CommError, match="must not be empty"):
        comm.all_reduce(x, ())


def test_stats_off_by_default_and_counting():
    assert not comm.stats_enabled()
    comm.record("all_reduce", 100)
    assert comm.stats_snapshot() == {}
    comm.enable_stats()
    comm.record("all_reduce", 100)
    comm.record("all_reduce", 20)
    comm.record("reduce_scatter(fallback)", 8)
    assert comm.stats_snapshot() == {"all_reduce": {"calls": 2, "bytes": 120},
                                     "reduce_scatter(fallback)": {"calls": 1, "bytes": 8}}
    assert comm.global_stats().fallbacks == {"reduce_scatter": 1}
    assert comm.global_stats().calls() == 3 and comm.global_stats().bytes("all_reduce") == 120
    comm.disable_stats()
    comm.record("all_reduce", 100)
    assert comm.stats_snapshot()["all_reduce"]["calls"] == 2
    comm.reset_stats()
    assert comm.stats_snapshot() == {}


def test_count_collectives_scopes_nest_and_are_live():
    with comm.count_collectives() as outer:
        comm.record("all_gather", 4)
        with comm.count_collectives() as inner:
            comm.record("all_gather", 6)
            assert inner.snapshot() == {"all_gather": {"calls": 1, "bytes": 6}}
        assert outer.snapshot() == {"all_gather": {"calls": 2, "bytes": 10}}
    comm.record("all_gather", 1)  # after the block: not counted, and the global counter is off
    assert outer.calls("all_gather") == 2 and inner.calls() == 1
    assert comm.stats_snapshot() == {}
    from nnscaler.runtime.comm import stats
    assert stats._ON is False  # recording is back to a single failed bool check


def test_fallback_plan_documents_torch_2_13_gloo():
    # measured on torch 2.13 CPU: gloo has all_gather_single, reduce_scatter_single and
    # all_to_all_single natively (even sizes); only uneven all-gather and PREMUL_SUM are missing.
    assert comm.fallback_plan("gloo", "cpu") == {c: "native" for c in fallbacks.COLLECTIVES}
    assert comm.fallback_plan("nccl", "cuda") == {c: "native" for c in fallbacks.COLLECTIVES}
    for backend, device in [("gloo", "cuda"), ("mpi", "cpu"), ("ucc", "cuda")]:
        assert all(v != "native" for v in comm.fallback_plan(backend, device).values())
    assert "all_reduce" in comm.fallback_plan("gloo", "cuda")["reduce_scatter"]
    with comm.force_fallback("all_to_all"):
        assert fallbacks.uses_fallback("all_to_all", "gloo", "cpu")
        assert not fallbacks.uses_fallback("reduce_scatter", "gloo", "cpu")
        with comm.force_fallback():
            assert fallbacks.uses_fallback("reduce_scatter", "gloo", "cpu")
        assert not fallbacks.uses_fallback("reduce_scatter", "gloo", "cpu")
    assert not fallbacks.uses_fallback("all_to_all", "gloo", "cpu")
    with pytest.raises(ValueError, match="unknown collectives"):
        with comm.force_fallback("broadcast"):
            pass


def test_fallback_environment_variable(monkeypatch):
    monkeypatch.setenv("NNSCALER_COMM_FALLBACK", "reduce_scatter, all_to_all")
    assert fallbacks._env_forced() == {"reduce_scatter", "all_to_all"}
    monkeypatch.setenv("NNSCALER_COMM_FALLBACK", "all")
    assert fallbacks._env_forced() == set(fallbacks.COLLECTIVES)
    monkeypatch.setenv("NNSCALER_COMM_FALLBACK", "allreduce")
    with pytest.raises(ValueError, match="NNSCALER_COMM_FALLBACK names unknown collectives"):
        fallbacks._env_forced()


def test_world_of_one_rank(world1):
    assert comm.group_for((0,)) is dist.group.WORLD
    x = torch.randn(4, 6, requires_grad=True)
    comm.enable_stats()
    for name in ONE_ARG + DIM_ARG + ["all_to_all"]:
        assert _call(name, x, (0,)) is x
    assert comm.stats_snapshot() == {}


# -- two gloo ranks -------------------------------------------------------------------------------
def _full(seed, shape=(4, 6), dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _run(name, x, grad, ranks, **kwargs):
    """Apply `name` to a leaf copy of `x`, backprop `grad`; (out, contiguous, x.grad, fwd, bwd)."""
    leaf = x.detach().clone().requires_grad_()
    with comm.count_collectives() as fwd:
        y = getattr(comm, name)(leaf, **kwargs, ranks=ranks)
    with comm.count_collectives() as bwd:
        y.backward(grad)
    return y.detach(), y.is_contiguous(), leaf.grad, fwd.snapshot(), bwd.snapshot()


def _unit_job(rank, world):
    ranks = (0, 1)
    k = rank
    x, g = _full(0), _full(1)
    xt = _full(2, (6, 4)).t()  # a non-contiguous (4, 6) input
    out = {"backend": dist.get_backend(comm.group_for(ranks))}
    for forced in (False, True):
        ctx = comm.force_fallback() if forced else contextlib.nullcontext()
        with ctx:
            tag = "fallback" if forced else "native"
            out[tag, "split"] = _run("split", x, g.chunk(2, 1)[k], ranks, dim=1)
            out[tag, "split_nc"] = _run("split", xt, g.chunk(2, 0)[k], ranks, dim=0)
            out[tag, "all_gather"] = _run("all_gather", x.chunk(2, 0)[k], g, ranks, dim=0)
            out[tag, "all_gather_nc"] = _run("all_gather", xt[:, 3 * k:3 * k + 3], g, ranks, dim=-1)
            out[tag, "all_reduce"] = _run("all_reduce", x * (k + 1), g, ranks)
            out[tag, "reduce_scatter"] = _run("reduce_scatter", x * (k + 1), g.chunk(2, 1)[k], ranks, dim=1)
            out[tag, "all_to_all"] = _run("all_to_all", x.chunk(2, 0)[k], g.chunk(2, 1)[k], ranks,
                                          src_dim=0, dst_dim=1)
            out[tag, "to_partial"] = _run("to_partial", x, g, ranks)
            out[tag, "shard_to_partial"] = _run("shard_to_partial", x.chunk(2, 1)[k], g, ranks, dim=1)
            out[tag, "grad_all_reduce"] = _run("grad_all_reduce", x, g * (k + 1), ranks)
            out[tag, "all_gather_rs"] = _run("all_gather_rs", x.chunk(2, 1)[k], g * (k + 1), ranks, dim=1)
            out[tag, "all_reduce_ar"] = _run("all_reduce_ar", x * (k + 1), g * (k + 1), ranks)
    # dtypes and the global counter
    comm.enable_stats()
    out["bf16"] = comm.reduce_scatter(torch.ones(4, 6, dtype=torch.bfloat16), 0, ranks)
    out["int64"] = comm.all_to_all(torch.arange(12).view(2, 6) + 100 * k, 0, 1, ranks)
    out["global"] = comm.stats_snapshot()
    comm.disable_stats()
    comm.reset_stats()
    # inputs without requires_grad work and give outputs without it
    y = comm.all_gather(x.chunk(2, 0)[k], 0, ranks)
    out["no_grad_input"] = (y.requires_grad, torch.equal(y, x))
    return out


# What each function must give on piece k: (output, input grad, collectives of fwd + bwd)
def _expected(name, k, x, g):
    two = 3.0  # sum over the 2 ranks of (k + 1)
    return {
        "split": (x.chunk(2, 1)[k], g, {"all_gather": 1}),
        "split_nc": (_full(2, (6, 4)).t().chunk(2, 0)[k], g, {"all_gather": 1}),
        "all_gather": (x, g.chunk(2, 0)[k], {"all_gather": 1}),
        "all_gather_nc": (_full(2, (6, 4)).t(), g[:, 3 * k:3 * k + 3], {"all_gather": 1}),
        "all_reduce": (x * two, g, {"all_reduce": 1}),
        "reduce_scatter": ((x * two).chunk(2, 1)[k], g, {"reduce_scatter": 1, "all_gather": 1}),
        "all_to_all": (x.chunk(2, 1)[k], g.chunk(2, 0)[k], {"all_to_all": 2}),
        "to_partial": (x if k == 0 else torch.zeros_like(x), g, {}),
        "shard_to_partial": (torch.cat([x.chunk(2, 1)[0], torch.zeros(4, 3)], 1) if k == 0 else
                             torch.cat([torch.zeros(4, 3), x.chunk(2, 1)[1]], 1),
                             g.chunk(2, 1)[k], {}),
        "grad_all_reduce": (x, g * two, {"all_reduce": 1}),
        "all_gather_rs": (x, (g * two).chunk(2, 1)[k], {"all_gather": 1, "reduce_scatter": 1}),
        "all_reduce_ar": (x * two, g * two, {"all_reduce": 2}),
    }[name]


@pytest.mark.multiprocess
def test_each_function_on_two_ranks():
    results = run_workers(_unit_job, 2, timeout=120)
    x, g = _full(0), _full(1)
    names = ["split", "split_nc", "all_gather", "all_gather_nc", "all_reduce", "reduce_scatter",
             "all_to_all", "to_partial", "shard_to_partial", "grad_all_reduce", "all_gather_rs",
             "all_reduce_ar"]
    for k, res in enumerate(results):
        assert res["backend"] == "gloo"
        for tag in ("native", "fallback"):
            for name in names:
                y, contiguous, xgrad, fwd, bwd = res[tag, name]
                want_y, want_grad, want_calls = _expected(name, k, x, g)
                where = f"{tag} {name} rank {k}"
                torch.testing.assert_close(y, want_y, msg=where)
                torch.testing.assert_close(xgrad, want_grad, msg=where)
                assert contiguous, where
                calls = {}
                for snap in (fwd, bwd):
                    for c, v in snap.items():
                        calls[c] = calls.get(c, 0) + v["calls"]
                suffix = "(fallback)" if tag == "fallback" else ""
                assert calls == {(c if c == "all_reduce" else c + suffix): v
                                 for c, v in want_calls.items()}, (where, fwd, bwd)
        # forward/backward placement of the collectives, native run
        fwd, bwd = res["native", "split"][3:]
        assert fwd == {} and bwd == {"all_gather": {"calls": 1, "bytes": 4 * 3 * 4}}  # payload: grad shard
        fwd, bwd = res["native", "all_gather_rs"][3:]
        assert fwd == {"all_gather": {"calls": 1, "bytes": 4 * 3 * 4}}  # payload: the local shard
        assert bwd == {"reduce_scatter": {"calls": 1, "bytes": 4 * 6 * 4}}  # payload: the full input
        fwd, bwd = res["native", "all_to_all"][3:]
        assert fwd == bwd == {"all_to_all": {"calls": 1, "bytes": 2 * 6 * 4}}
        fwd, bwd = res["native", "grad_all_reduce"][3:]
        assert fwd == {} and bwd == {"all_reduce": {"calls": 1, "bytes": 4 * 6 * 4}}
        # the fallbacks record the payload of the collective they run
        fwd, _ = res["fallback", "reduce_scatter"][3:]
        assert fwd == {"reduce_scatter(fallback)": {"calls": 1, "bytes": 4 * 6 * 4}}
        # dtypes, global counter
        assert torch.equal(res["bf16"], torch.full((2, 6), 2.0, dtype=torch.bfloat16))
        full = torch.cat([torch.arange(12).view(2, 6), torch.arange(12).view(2, 6) + 100])
        assert torch.equal(res["int64"], full.chunk(2, 1)[k])
        assert res["global"] == {"reduce_scatter": {"calls": 1, "bytes": 4 * 6 * 2},
                                 "all_to_all": {"calls": 1, "bytes": 2 * 6 * 8}}
        assert res["no_grad_input"] == (False, True)
