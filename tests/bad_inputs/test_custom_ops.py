"""Custom ops (`register_op`) whose annotation is wrong, does not fit the call, or is registered twice."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from nnscaler.ir import TraceError, trace
from nnscaler.ir.ops.custom_op_check import clear_cache
from nnscaler.ir.ops.registry import REGISTRY, register_op

CALLS = {"n": 0}


def cumsum_rows(x):
    """A row-wise cumulative sum: mixes the values of each row (dim 1)."""
    CALLS["n"] += 1
    return torch.cumsum(x, dim=1)


wrong_cumsum = register_op(cumsum_rows, "a b -> a b", name="tests.wrong_cumsum")


@register_op("a b^ -> a b^")
def right_cumsum(x):
    return torch.cumsum(x, dim=1)


@register_op("a k+ -> a")
def row_max(x):  # max is not a sum: splitting k gives partial maxima, not partial sums
    return x.max(dim=1).values


@register_op("a k+ -> a")
def row_sum(x):  # a sum: split along k the partial sums add up (within float32 rounding)
    return x.sum(dim=1)


@register_op("a -> a")
def flat_op(x):
    return x * 2


@register_op("a b, a b -> a b")
def add_first_row(x, w):  # w has fewer rows than x: 'a' has two sizes
    return x + w[:1]


class Uses(nn.Module):
    def __init__(self, op, *weights):
        super().__init__()
        self.op = op
        self.weights = nn.ParameterList([nn.Parameter(w) for w in weights])

    def forward(self, x):
        return self.op(x, *self.weights).sum()


def _trace(op, x, *weights):
    clear_cache()
    return trace(Uses(op, *weights), {"x": x})


def test_wrong_annotation_is_refused_naming_op_dim_and_fix():
    with pytest.raises(TraceError) as info:
        _trace(wrong_cumsum, torch.randn(4, 6))
    msg = str(info.value)
    assert "tests.wrong_cumsum" in msg and "'a b -> a b'" in msg
    assert "dim 'b'" in msg and "'x' dim 1" in msg
    assert "'a b^ -> a b'" in msg and "override=True" in msg  # the fix, spelled out
    assert "test_custom_ops.py" in msg  # the user's line that calls the op


def test_right_annotation_traces_and_is_kept():
    graph = _trace(right_cumsum, torch.randn(4, 6))
    node = next(n for n in graph.nodes if n.target.endswith("right_cumsum"))
    assert node.annotation == "a b^ -> a b^"


def test_wrong_reduction_is_refused():
    with pytest.raises(TraceError, match=r"row_max.*dim 'k'.*summed"):
        _trace(row_max, torch.randn(4, 6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_reordered_sum_passes_within_the_dtype_tolerance(dtype):
    x = (torch.randn(8, 4096) * 100).to(dtype)  # long float sums: rounding differs by split, not wrongly
    graph = _trace(row_sum, x)
    assert any(n.target.endswith("row_sum") for n in graph.nodes)


def test_rank_mismatch_names_the_argument():
    with pytest.raises(TraceError) as info:
        _trace(flat_op, torch.randn(4, 6))
    msg = str(info.value)
    assert "flat_op" in msg and "does not fit" in msg and "argument 'x' with shape (4, 6)" in msg


def test_inconsistent_sizes_name_the_argument():
    with pytest.raises(TraceError) as info:
        _trace(add_first_row, torch.randn(4, 6), torch.randn(2, 6))
    msg = str(info.value)
    assert "add_first_row" in msg and "dim 'a'" in msg and "argument 'w' with shape (2, 6)" in msg


def test_check_is_cached_per_op_annotation_and_shapes():
    class Twice(nn.Module):
        def forward(self, x):
            return wrong_cumsum(x[:, :1]) + wrong_cumsum(x[:, 1:2])  # width 1: 'b' cannot split, 'a' can

    clear_cache()
    CALLS["n"] = 0
    trace(Twice(), {"x": torch.randn(4, 6)}, both_modes=False)
    # first call: the traced call, the reference twice (a random op is not compared), 2 pieces along
    # 'a'; second call (same shapes): the traced call only
    assert CALLS["n"] == 1 + 2 + 2 + 1
    CALLS["n"] = 0
    trace(Twice(), {"x": torch.randn(4, 6)}, both_modes=False)
    assert CALLS["n"] == 2  # cached across traces


def test_registering_twice_is_refused_unless_override():
    def scale(x):
        return x * 3

    first = register_op(scale, "a -> a")
    assert register_op(scale, "a -> a") is first  # the same registration again: a no-op
    with pytest.raises(ValueError, match=r"already registered with the annotation 'a -> a'.*override=True"):
        register_op(scale, "... -> ...")
    again = register_op(scale, "... -> ...", override=True)
    assert REGISTRY.lookup(again, (torch.ones(2),), {}) == "... -> ..."


def test_registering_a_taken_name_is_refused():
    def one(x):
        return x

    def other(x):
        return x

    register_op(one, "a -> a", name="tests.taken_name")
    with pytest.raises(ValueError, match=r"'tests.taken_name' is already registered for another function"):
        register_op(other, "a -> a", name="tests.taken_name")
    register_op(other, "a -> a", name="tests.taken_name", override=True)


def test_registering_a_builtin_op_is_refused():
    with pytest.raises(ValueError, match=r"torch.nn.functional.linear is already registered"):
        register_op(torch.nn.functional.linear, "a b, c b -> a c")


def test_wrong_annotation_of_a_torch_function_is_refused():
    """register_op on a torch function (what the plan report suggests for unannotated ops): the
    function is called directly by the model, and its annotation is checked all the same."""
    class CumProd(nn.Module):
        def forward(self, x):
            return torch.cumprod(x, dim=1).sum()

    wrappers = [register_op(torch.cumprod, "a b -> a b")]
    try:
        clear_cache()
        with pytest.raises(TraceError, match=r"custom op torch.cumprod: .*dim 'b'.*'a b\^ -> a b'"):
            trace(CumProd(), {"x": torch.rand(4, 6) + 0.5})
        wrappers.append(register_op(torch.cumprod, "a b^ -> a b^", override=True))
        graph = trace(CumProd(), {"x": torch.rand(4, 6) + 0.5})
        assert [n.annotation for n in graph.nodes if n.target == "torch.cumprod"] == ["a b^ -> a b^"]
    finally:  # leave the registry as the other tests expect it
        for f in (torch.cumprod, *wrappers):
            REGISTRY._ops.pop(f, None)
            REGISTRY._user.discard(f)


def test_parallelize_with_tp_refuses_the_wrong_annotation(tmp_path):
    from nnscaler import ComputeConfig, parallelize
    model = Uses(wrong_cumsum)
    clear_cache()
    with pytest.raises(TraceError, match=r"tests.wrong_cumsum.*dim 'b'") as info:
        parallelize(model, {"x": torch.randn(4, 6)}, "tp", ComputeConfig(2, 2, trace_strategy="cpu"),
                    gen_savedir=tmp_path, load_module=False)
    assert "\n" not in str(info.value)  # one message, traceback cut at the user's call


@register_op("a b -> a b")
def double_(x):  # in place: the traced call has already changed x when the check runs
    return x.mul_(2)


@register_op("a b -> a b")
def noisy(x):  # random: two runs differ, so the numbers cannot be compared (not refused)
    return x + torch.rand_like(x)


class InPlace(nn.Module):
    def forward(self, x):
        h = x * 1.0
        return double_(h).sum()


def test_in_place_custom_op_with_a_right_annotation_passes():
    clear_cache()
    graph = trace(InPlace(), {"x": torch.randn(4, 6)})
    assert any(n.target.endswith("double_") for n in graph.nodes)


def test_random_custom_op_is_not_refused_and_leaves_the_rng_alone():
    x = torch.randn(4, 6)
    torch.manual_seed(3)
    expected = torch.rand(3)
    torch.manual_seed(3)
    graph = _trace(noisy, x)
    assert any(n.target.endswith("noisy") for n in graph.nodes)
    assert torch.equal(torch.rand(3), expected)  # the trace (and the check) restored the RNG


def _broken_annotation(x):
    return "a b -> a b" if x.shape[5] else None  # IndexError for a 2-D x


@register_op(annotation=_broken_annotation)
def computed(x):
    return x * 2


def test_annotation_function_that_raises_is_an_error_not_a_replication():
    with pytest.raises(TraceError, match=r"annotation function '_broken_annotation' of custom op .*computed raised "
                                         r"IndexError"):
        _trace(computed, torch.randn(4, 6))
