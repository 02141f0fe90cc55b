"""TracedInt: shape ints that record their arithmetic (constant folding off) and fold to plain
Python values when they leave the int domain."""
import copy
import math
import operator
import pickle

import pytest
import torch
import torch.nn as nn

from nnscaler.ir import Ref, trace
from nnscaler.ir.tracer.symbolic_int import TracedInt


class Probe(nn.Module):
    """Runs `fn(x)` inside forward, keeps what it returned in `self.seen`, returns `x.view(...)`."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn
        self.record = {}  # mutated, not reassigned: tracing restores plain attributes it changed

    @property
    def seen(self):
        return self.record.get("seen")

    def forward(self, x):
        self.record["seen"] = self.fn(x)
        return x + 0


def probe(fn, shape=(2, 3), **kw):
    m = Probe(fn)
    g = trace(m, {"x": torch.randn(*shape)}, **kw)
    return g, m.seen


def nodes_by_output(g):
    return {r.id: n for n in g.nodes for r in n.output_refs()}


class ShapeMath(nn.Module):
    """Returns x reshaped by `fn(a, b)` so the recorded arithmetic stays live."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        a, b = x.shape
        return x.reshape(self.fn(a, b), -1)


@pytest.mark.parametrize("fn,op,value,args", [
    (lambda a, b: a + 1, "add", 3, ["a", 1]),
    (lambda a, b: 1 + a, "add", 3, [1, "a"]),
    (lambda a, b: b - a, "sub", 4, ["b", "a"]),
    (lambda a, b: 8 - b, "sub", 2, [8, "b"]),
    (lambda a, b: a * b, "mul", 12, ["a", "b"]),
    (lambda a, b: 3 * a, "mul", 6, [3, "a"]),
    (lambda a, b: b // a, "floordiv", 3, ["b", "a"]),
    (lambda a, b: 12 // b, "floordiv", 2, [12, "b"]),
    (lambda a, b: b % 4 + 2, "add", 4, [None, 2]),
    (lambda a, b: 5 % a, "mod", 1, [5, "a"]),
    (lambda a, b: -(-a), "neg", 2, [None]),
])
def test_arithmetic_is_recorded(fn, op, value, args):
    g = trace(ShapeMath(fn), {"x": torch.randn(2, 6)})
    shape_node = g.nodes[0]
    a_ref, b_ref = shape_node.outputs
    assert shape_node.target == "getattr" and shape_node.args[1] == "shape"
    reshape = next(n for n in g.nodes if n.target == "torch.Tensor.reshape")
    assert g.value(reshape.outputs).shape == (value, 12 // value)
    producer = nodes_by_output(g)[reshape.args[1].id]
    assert producer.target == f"operator.{op}"
    names = {"a": a_ref, "b": b_ref}
    for got, want in zip(producer.args, args):
        if want is None:  # produced by an earlier recorded op
            assert isinstance(got, Ref) and got not in (a_ref, b_ref)
        else:
            assert got == names.get(want, want)
    assert len(producer.args) == len(args)
    assert g.value(producer.outputs).kind == "int"


def test_traced_ints_are_real_ints():
    g, (a, b, n) = probe(lambda x: (*x.size(), x.numel()))
    assert isinstance(a, TracedInt) and isinstance(a, int)
    assert (a, b, n) == (2, 3, 6)
    assert a < b and a == 2 and hash(a) == hash(2)
    assert list(range(a)) == [0, 1] and [10, 20, 30][a] == 30
    assert repr(a) == "TracedInt(2)"
    assert str(a) == "2" and f"{a}" == "2" and f"{b:03d}" == "003" and "%d" % a == "2"


@pytest.mark.parametrize("fn,expected", [
    (lambda a: float(a), 2.0),
    (lambda a: math.sqrt(a * 2), 2.0),
    (lambda a: a / 4, 0.5),
    (lambda a: a < 3, True),
    (lambda a: a == 2, True),
    (lambda a: a + 0.5, 2.5),
    (lambda a: a ** 3, 8),
    (lambda a: a & 3, 2),
    (lambda a: a + True, 3),
    (lambda a: int(a), 2),
    (lambda a: copy.copy(a), 2),
    (lambda a: pickle.loads(pickle.dumps(a)), 2),
])
def test_leaving_the_int_domain_folds(fn, expected):
    g, out = probe(lambda x: fn(x.size(0)))
    assert out == expected and type(out) is type(expected)
    assert not any(n.target.startswith("operator.") for n in g.nodes)


def test_folded_value_reaches_ops_as_a_constant():
    class Scaled(nn.Module):
        def forward(self, x):
            d = x.size(-1)
            return x.view(-1, int(d * 1.5)) / math.sqrt(d)

    g = trace(Scaled(), {"x": torch.randn(3, 4)})
    view, div = g.nodes
    assert view.args[1:] == [-1, 6] and div.args[1] == 2.0
    assert not any(v.kind == "int" for v in g.values.values())


def test_traced_size_numel_records_products():
    class Flat(nn.Module):
        def forward(self, x):
            return x.reshape(x.shape.numel())

    g = trace(Flat(), {"x": torch.randn(2, 3, 4)})
    assert [n.target for n in g.nodes] == ["getattr", "operator.mul", "operator.mul", "operator.mul",
                                           "torch.Tensor.reshape"]
    assert g.nodes[1].args == [1, g.nodes[0].outputs[0]]
    assert g.nodes[-1].args[1] == g.nodes[3].outputs
    assert g.value(g.output).shape == (24,)


def test_numel_and_size_dim_are_recorded():
    class Both(nn.Module):
        def forward(self, x):
            return x.view(x.numel() // x.size(-1), x.size(-1))

    g = trace(Both(), {"x": torch.randn(2, 3, 4)})
    assert [n.target for n in g.nodes] == ["torch.Tensor.numel", "torch.Tensor.size", "operator.floordiv",
                                           "torch.Tensor.size", "torch.Tensor.view"]
    assert g.nodes[1].args[1:] == [-1]
    assert g.nodes[4].args[1:] == [g.nodes[2].outputs, g.nodes[3].outputs]


def test_traced_int_as_graph_output():
    class Count(nn.Module):
        def forward(self, x):
            return x * 2, x.size(0) * 4

    g = trace(Count(), {"x": torch.randn(3, 2)})
    t_ref, n_ref = g.output
    assert g.value(n_ref).kind == "int"
    assert nodes_by_output(g)[n_ref.id].target == "operator.mul"
    folded = trace(Count(), {"x": torch.randn(3, 2)}, constant_folding=True)
    assert folded.output[1] == 12 and isinstance(folded.output[0], Ref)


def test_constant_folding_gives_plain_ints():
    g, (size, shape) = probe(lambda x: (x.size(), x.shape), constant_folding=True)
    assert type(size) is torch.Size and type(shape) is torch.Size
    assert all(type(d) is int for d in size + shape)
    assert [n.target for n in g.nodes] == ["torch.Tensor.add"]


def test_int_ops_are_operator_functions():
    """The recorded target names a real function that computes the same value."""
    g = trace(ShapeMath(lambda a, b: (b - a) * 2 // a), {"x": torch.randn(2, 6)})
    ops = [n for n in g.nodes if n.target.startswith("operator.")]
    assert [n.target for n in ops] == ["operator.sub", "operator.mul", "operator.floordiv"]
    env = dict(zip([r.id for r in g.nodes[0].outputs], (2, 6)))
    for n in ops:
        fn = getattr(operator, n.target.split(".")[1])
        env[n.outputs.id] = fn(*(env[a.id] if isinstance(a, Ref) else a for a in n.args))
    assert env[ops[-1].outputs.id] == (6 - 2) * 2 // 2
