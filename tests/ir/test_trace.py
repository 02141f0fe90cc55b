"""trace(): what the recorded IRGraph says about real models (ops, shapes, dtypes, module paths,
source lines), Python control flow, parameters/buffers/constants, constant folding, dead code,
in-place ops, leaving the module untouched, forward inputs and error reporting."""
import collections
import inspect
import os
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from nnscaler.ir import IRGraph, TraceError, trace

torch.manual_seed(0)
HERE = os.path.realpath(__file__)


def line_of(func, text):
    """The line number in this file of the one line of `func` containing `text`."""
    lines, start = inspect.getsourcelines(func)
    hits = [start + i for i, line in enumerate(lines) if text in line]
    assert len(hits) == 1, (text, hits)
    return hits[0]


def targets(g: IRGraph):
    return [n.target for n in g.nodes]


def out_value(g, node, i=None):
    refs = node.output_refs()
    return g.value(refs[0] if i is None else refs[i])


# ----------------------------------------------------------------------------- models
class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)])

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.relu(x)
        return x


class Block(nn.Module):
    """A pre-norm transformer block with hand-written attention."""

    def __init__(self, d=8, heads=2):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q = q.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        k = k.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        v = v.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        att = F.softmax(q @ k.transpose(-2, -1) / (C // self.heads) ** 0.5, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        x = x + self.proj(y)
        return x + self.mlp(self.ln2(x))


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(4 * 4 * 4, 10)

    def forward(self, img):
        h = F.relu(self.conv(img))
        h = self.pool(h)
        h = torch.flatten(h, 1)
        return self.fc(h)


# ----------------------------------------------------------------------------- whole models
def test_mlp_ops_shapes_module_paths_and_sources():
    m = MLP()
    g = trace(m, {"x": torch.randn(2, 8)})
    assert targets(g) == ["torch.nn.functional.linear", "torch.relu"] * 2 + ["torch.nn.functional.linear"]
    assert [n.module_path for n in g.nodes] == ["layers.0", "", "layers.1", "", "layers.2"]
    assert [out_value(g, n).shape for n in g.nodes] == [(2, 16)] * 4 + [(2, 4)]
    assert {out_value(g, n).dtype for n in g.nodes} == {"float32"}
    assert [[g.value(r).shape for r in n.input_refs()] for n in g.nodes] == [
        [(2, 8), (16, 8), (16,)], [(2, 16)], [(2, 16), (16, 16), (16,)], [(2, 16)], [(2, 16), (4, 16), (4,)]]
    assert {g.value(r).dtype for n in g.nodes for r in n.input_refs()} == {"float32"}
    x_ref = g.inputs[0].leaves[0][1]
    assert g.value(x_ref).shape == (2, 8)
    first = g.nodes[0]
    assert first.args == [x_ref, g.params["layers.0.weight"].value, g.params["layers.0.bias"].value]
    for a, b in zip(g.nodes, g.nodes[1:]):  # a chain: each op consumes the previous output
        assert b.args[0] == a.outputs
    assert g.output == g.nodes[-1].outputs
    assert first.annotation  # looked up in the op registry
    lin_line = line_of(MLP.forward, "x = layer(x)")
    relu_line = line_of(MLP.forward, "x = torch.relu(x)")
    for n in g.nodes:
        assert os.path.realpath(n.source.file) == HERE
        assert n.source.function == "MLP.forward"
        expected = lin_line if n.target.endswith("linear") else relu_line
        assert n.source.line == expected
        assert n.source.code == ("x = layer(x)" if expected == lin_line else "x = torch.relu(x)")


def test_transformer_block():
    g = trace(Block(), {"x": torch.randn(2, 5, 8)})
    by_target = collections.Counter(targets(g))
    assert by_target["torch.nn.functional.linear"] == 4
    assert by_target["torch.nn.functional.layer_norm"] == 2
    assert by_target["torch.Tensor.matmul"] == 2
    assert by_target["torch.nn.functional.softmax"] == 1
    assert by_target["torch.nn.functional.gelu"] == 1
    assert [n.module_path for n in g.nodes if n.target.endswith("linear")] == ["qkv", "proj", "mlp.0", "mlp.2"]
    assert [n.module_path for n in g.nodes if n.target.endswith("gelu")] == ["mlp.1"]
    split = next(n for n in g.nodes if n.target == "torch.Tensor.split")
    assert [g.value(r).shape for r in split.output_refs()] == [(2, 5, 8)] * 3
    mm = [n for n in g.nodes if n.target == "torch.Tensor.matmul"]
    assert [out_value(g, n).shape for n in mm] == [(2, 2, 5, 5), (2, 2, 5, 4)]
    softmax = next(n for n in g.nodes if n.target.endswith("softmax"))
    assert softmax.kwargs["dim"] == -1
    assert softmax.source.line == line_of(Block.forward, "att = F.softmax(")
    assert g.value(g.output).shape == (2, 5, 8)
    assert len(g.params) == 12 and g.buffers == {} and g.constants == {}


def test_cnn():
    g = trace(CNN(), {"img": torch.randn(2, 3, 8, 8)})
    assert targets(g) == ["torch.nn.functional.conv2d", "torch.nn.functional.relu",
                          "torch.nn.functional.max_pool2d", "torch.flatten", "torch.nn.functional.linear"]
    assert [out_value(g, n).shape for n in g.nodes] == [(2, 4, 8, 8), (2, 4, 8, 8), (2, 4, 4, 4), (2, 64), (2, 10)]
    assert [n.module_path for n in g.nodes] == ["conv", "", "pool", "", "fc"]
    assert [[g.value(r).shape for r in n.input_refs()] for n in g.nodes] == [
        [(2, 3, 8, 8), (4, 3, 3, 3), (4,)], [(2, 4, 8, 8)], [(2, 4, 8, 8)], [(2, 4, 4, 4)], [(2, 64), (10, 64), (10,)]]
    conv = g.nodes[0]
    assert conv.args[1] == g.params["conv.weight"].value and conv.args[2] == g.params["conv.bias"].value
    assert conv.args[4] == (1, 1)  # padding
    assert g.nodes[3].args[1:] == [1]
    assert g.params["conv.weight"].shape == (4, 3, 3, 3)
    assert g.nodes[1].source.line == line_of(CNN.forward, "F.relu(self.conv(img))")


def test_dtypes_of_outputs():
    class Casts(nn.Module):
        def forward(self, x):
            return x.to(torch.float64), x.argmax(-1), x > 0, x.half()

    g = trace(Casts(), {"x": torch.randn(3, 4)})
    assert [g.value(r).dtype for r in g.output] == ["float64", "int64", "bool", "float16"]
    assert [g.value(r).shape for r in g.output] == [(3, 4), (3,), (3, 4), (3, 4)]


# ----------------------------------------------------------------------------- control flow
class Branchy(nn.Module):
    def forward(self, x):
        if x.shape[-1] > 4:
            x = x * 2
        else:
            x = x - 1
        for i in range(x.size(0)):
            x = x + i
        return x


@pytest.mark.parametrize("shape,first,adds", [((3, 8), "torch.Tensor.mul", 3), ((2, 3), "torch.Tensor.sub", 2)])
def test_control_flow_records_the_path_taken(shape, first, adds):
    g = trace(Branchy(), {"x": torch.randn(*shape)})
    assert targets(g) == [first] + ["torch.Tensor.add"] * adds  # shape reads feed no op: removed
    assert [n.args[1] for n in g.nodes[1:]] == list(range(adds))
    line = line_of(Branchy.forward, "x = x * 2" if first.endswith("mul") else "x = x - 1")
    assert g.nodes[0].source.line == line


# ----------------------------------------------------------------------------- params, buffers, constants
class Shared(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.shared = nn.Linear(4, 4)
        self.alias = self.shared  # the same submodule under a second name
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.register_buffer("scale", torch.full((4,), 2.0))
        self.register_buffer("offset", torch.zeros(4), persistent=False)
        self.table = torch.arange(4.0)  # a plain tensor attribute: a captured constant

    def forward(self, idx):
        h = self.alias(self.shared(self.emb(idx)))
        h = self.frozen(h) * self.scale + self.offset + self.table
        return self.head(h)


def test_tied_shared_frozen_params_buffers_and_constants():
    m = Shared()
    g = trace(m, {"idx": torch.tensor([1, 2, 3])})
    assert list(g.params) == ["emb.weight", "shared.weight", "shared.bias", "frozen.weight", "frozen.bias"]
    assert g.params["emb.weight"].aliases == ["head.weight"]
    assert g.params["shared.weight"].aliases == ["alias.weight"]
    assert g.params["shared.bias"].aliases == ["alias.bias"]
    assert set(g.frozen_params) == {"frozen.weight", "frozen.bias"}
    assert set(g.trainable_params) == {"emb.weight", "shared.weight", "shared.bias"}
    assert g.params["emb.weight"].shape == (10, 4)
    linears = [n for n in g.nodes if n.target.endswith("linear")]
    assert [n.module_path for n in linears] == ["shared", "shared", "frozen", "head"]
    assert linears[0].args[1] == linears[1].args[1] == g.params["shared.weight"].value
    assert linears[3].args[1] == g.params["emb.weight"].value  # the tied weight is one value
    assert list(g.buffers) == ["scale", "offset"]
    assert g.buffers["scale"].persistent and not g.buffers["offset"].persistent
    assert not g.buffers["scale"].requires_grad
    (name, const), = g.constants.items()
    assert const.shape == (4,) and const.dtype == "float32"
    assert torch.equal(const.tensor, torch.arange(4.0))
    adds = [n for n in g.nodes if n.target == "torch.Tensor.add"]
    assert adds[0].args[1] == g.buffers["offset"].value
    assert adds[1].args[1] == const.value


# ----------------------------------------------------------------------------- constant folding
class Reshaper(nn.Module):
    def forward(self, x):
        b, h, t, d = x.size()
        return x.view(b * h, t, d).sum(dim=-1)


def test_constant_folding_off_records_shape_arithmetic():
    g = trace(Reshaper(), {"x": torch.randn(2, 3, 5, 4)})
    assert targets(g) == ["torch.Tensor.size", "operator.mul", "torch.Tensor.view", "torch.Tensor.sum"]
    size, mul, view, _ = g.nodes
    b, h, t, d = size.outputs
    assert [g.value(r).kind for r in size.outputs] == ["int"] * 4
    assert mul.args == [b, h]
    assert view.args == [g.inputs[0].leaves[0][1], mul.outputs, t, d]
    assert g.value(view.outputs).shape == (6, 5, 4)
    assert not g.constant_folding


def test_constant_folding_on_bakes_ints():
    g = trace(Reshaper(), {"x": torch.randn(2, 3, 5, 4)}, constant_folding=True)
    assert targets(g) == ["torch.Tensor.view", "torch.Tensor.sum"]
    assert g.nodes[0].args[1:] == [6, 5, 4]
    assert all(type(a) is int for a in g.nodes[0].args[1:])
    assert all(v.kind == "tensor" for v in g.values.values())
    assert g.constant_folding


def test_dead_code_removed_but_inplace_kept():
    class Wasteful(nn.Module):
        def __init__(self):
            super().__init__()
            self.table = torch.ones(3)

        def forward(self, x):
            unused = torch.exp(x) * 3 + self.table
            n = x.size(0) * 2
            scratch = x.clone()
            scratch.mul_(2)  # mutates a tensor nothing reads: still kept
            return x + 1

    g = trace(Wasteful(), {"x": torch.randn(3)})
    assert targets(g) == ["torch.Tensor.clone", "torch.Tensor.mul_", "torch.Tensor.add"]
    assert g.nodes[1].inplace and g.nodes[1].args[0] == g.nodes[0].outputs
    assert g.constants == {}  # only the dead code used the captured tensor
    live = {r.id for n in g.nodes for r in n.input_refs() + n.output_refs()}
    assert set(g.values) == live  # the values of dropped ops are gone too
    assert not any(v.kind == "int" for v in g.values.values())


# ----------------------------------------------------------------------------- in-place ops
def test_inplace_ops_are_marked_and_rebind_the_variable():
    class Mutator(nn.Module):
        def forward(self, x, y):
            x = x.clone()
            x.add_(1)
            x[0] = y
            F.relu(x, inplace=True)
            x += 2
            return x * 3

    g = trace(Mutator(), {"x": torch.randn(3, 4), "y": torch.randn(4)})
    assert targets(g) == ["torch.Tensor.clone", "torch.Tensor.add_", "torch.Tensor.__setitem__",
                          "torch.nn.functional.relu", "torch.Tensor.add_", "torch.Tensor.mul"]
    assert [n.inplace for n in g.nodes] == [False, True, True, True, True, False]
    for prev, node in zip(g.nodes, g.nodes[1:]):  # every later use sees the mutated value
        assert node.args[0] == prev.outputs
        assert node.outputs != prev.outputs
    setitem = g.nodes[2]
    assert setitem.args[1:] == [0, g.inputs[1].leaves[0][1]]
    assert g.nodes[3].kwargs == {"inplace": True}
    assert g.value(g.output).shape == (3, 4)


# ----------------------------------------------------------------------------- inputs
def test_nested_inputs_and_defaults():
    class Batched(nn.Module):
        def forward(self, batch, scale=2.0, mask=None, *, tag="t"):
            return batch["a"] * scale + batch["b"][0] - batch["b"][1]

    g = trace(Batched(), {"batch": {"a": torch.randn(2), "b": [torch.randn(2), torch.randn(2)]}})
    batch, scale, mask, tag = g.inputs
    assert [p for p, _ in batch.leaves] == [("a",), ("b", 0), ("b", 1)]
    assert batch.traced and not batch.has_default
    assert (scale.has_default, scale.default, scale.traced, scale.leaves) == (True, 2.0, False, [])
    assert mask.has_default and mask.default is None and not mask.traced
    assert tag.kind == "KEYWORD_ONLY" and tag.default == "t"
    mul, add, sub = g.nodes
    assert mul.args == [batch.leaves[0][1], 2.0]
    assert add.args[1] == batch.leaves[1][1] and sub.args[1] == batch.leaves[2][1]
    assert g.constants == {}


def test_namedtuple_input_tensors_are_inputs_not_constants():
    Pair = collections.namedtuple("Pair", "a b")

    class UsesPair(nn.Module):
        def forward(self, pair):
            return pair.a + pair.b

    g = trace(UsesPair(), {"pair": Pair(torch.randn(2), torch.randn(2))})
    assert [p for p, _ in g.inputs[0].leaves] == [(0,), (1,)]
    assert g.constants == {}
    assert g.nodes[0].args == [r for _, r in g.inputs[0].leaves]


def test_var_keyword_forward_receives_extra_dummy_args():
    class Kw(nn.Module):
        def forward(self, x, **kwargs):
            return x + kwargs["mask"]

    g = trace(Kw(), {"x": torch.randn(2), "mask": torch.ones(2)})
    assert [(i.name, i.kind, i.traced) for i in g.inputs] == [
        ("x", "POSITIONAL_OR_KEYWORD", True), ("mask", "KEYWORD_ONLY", True), ("kwargs", "VAR_KEYWORD", False)]
    assert g.nodes[0].args == [g.inputs[0].leaves[0][1], g.inputs[1].leaves[0][1]]


@pytest.mark.parametrize("strategy", ["cpu", "meta"])
def test_one_tensor_given_for_two_inputs_stays_two_inputs(strategy):
    """``{"input_ids": ids, "labels": ids}`` (one object twice, as a causal LM's example input
    often is): each argument is its own graph input, so the program reads input_ids where forward
    does (it read the last one bound, labels, and trained on the labels). A weight passed as an
    input is an input too."""
    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 4)

        def forward(self, input_ids, labels, w):
            return self.emb(input_ids).sum() + labels.sum() * w.sum()

    lm = LM()
    ids = torch.randint(0, 10, (2, 3))
    g = trace(lm, {"input_ids": ids, "labels": ids, "w": lm.emb.weight}, trace_strategy=strategy)
    (_, ids_ref), = g.inputs[0].leaves
    (_, labels_ref), = g.inputs[1].leaves
    (_, w_ref), = g.inputs[2].leaves
    assert len({ids_ref.id, labels_ref.id, w_ref.id}) == 3
    emb = next(n for n in g.nodes if n.target.endswith("embedding"))
    assert emb.args[0] == ids_ref, emb.args
    reads = [r for n in g.nodes for r in n.input_refs()]
    assert labels_ref in reads and w_ref in reads


def test_numpy_scalars_are_recorded_as_numbers():
    class Np(nn.Module):
        def forward(self, x):
            return x.view(np.prod(x.shape[:1]), -1) * np.float32(0.5)

    g = trace(Np(), {"x": torch.randn(2, 3)}, constant_folding=True)
    assert g.nodes[0].args[1:] == [2, -1] and type(g.nodes[0].args[1]) is int
    assert g.nodes[1].args[1] == 0.5 and type(g.nodes[1].args[1]) is float


class Needs(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, x, y=None):
        return self.l(x)


@pytest.mark.parametrize("module,args,words", [
    (lambda x: x, {"x": torch.ones(1)}, ["torch.nn.Module", "function"]),
    (Needs(), [torch.ones(2, 4)], ["dummy_forward_args", "dict", "list"]),
    (Needs(), {"x": torch.ones(2, 4), "z": 1}, ["'z'", "Needs.forward", "['x', 'y']"]),
    (Needs(), {"y": torch.ones(2, 4)}, ["missing 'x'", "Needs.forward"]),
])
def test_bad_arguments_raise_clear_type_errors(module, args, words):
    with pytest.raises(TypeError) as e:
        trace(module, args)
    for w in words:
        assert w in str(e.value)


def test_variadic_positional_dummy_arg_is_refused():
    class Star(nn.Module):
        def forward(self, *xs):
            return xs[0]

    with pytest.raises(TypeError, match=r"'xs'.*\*xs parameter of .*Star.forward"):
        trace(Star(), {"xs": [torch.ones(1)]})


def test_failing_forward_raises_trace_error_naming_the_user_line():
    m = Needs()
    with pytest.raises(TraceError) as e:
        trace(m, {"x": torch.randn(2, 5)})
    line = line_of(Needs.forward, "return self.l(x)")
    assert f"{HERE}:{line}" in str(e.value) or f"{__file__}:{line}" in str(e.value)
    assert "torch.nn.functional.linear" in str(e.value)
    assert isinstance(e.value.__cause__, RuntimeError)
    trace(m, {"x": torch.randn(2, 4)})  # the failed trace left no hooks behind
    assert m.l.weight.grad is None


def test_trace_is_deterministic():
    m = Block()
    a = trace(m, {"x": torch.randn(2, 5, 8)})
    b = trace(m, {"x": torch.randn(2, 5, 8)})
    assert a.fingerprint() == b.fingerprint()
    c = trace(m, {"x": torch.randn(2, 6, 8)})
    assert c.fingerprint() != a.fingerprint()


def test_reading_a_traced_tensors_value_warns_at_the_users_line():
    from nnscaler.ir import TracingWarning

    class DataDependent(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(4, 4)
            self.scale = torch.tensor(3.0)  # a captured constant: reading it is fine

        def forward(self, x):
            h = self.l(x)
            for _ in range(3):
                if h.sum() > 0:  # one warning for this line, not three
                    h = h * 2
            k = float(self.scale) + h.shape[0]  # shapes and constants: no warning
            repr(h)  # printing reads values but changes nothing
            return h.sum() * k + h.mean().item()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trace(DataDependent(), {"x": torch.randn(2, 4)})
    ours = [w for w in caught if issubclass(w.category, TracingWarning)]
    assert [(os.path.basename(w.filename), w.lineno) for w in ours] == [
        ("test_trace.py", line_of(DataDependent.forward, "if h.sum() > 0")),
        ("test_trace.py", line_of(DataDependent.forward, "h.mean().item()"))]
    # what was read, what it derives from, and what the program does now (nnscaler.ir.tracer.guards / branches)
    first, second = str(ours[0].message), str(ours[1].message)
    assert "bool(tensor)" in first and "forward's argument `x`" in first
    assert "both branches are generated" in first or "GuardError" in first
    assert "tensor.item()" in second and "forward's argument `x`" in second
    # the line's code is said once: Python prints it under the message
    shown = warnings.formatwarning(ours[1].message, ours[1].category, ours[1].filename, ours[1].lineno)
    assert shown.count("return h.sum() * k") == 1, shown
    assert "raises nnscaler.runtime.GuardError" in second and "torch.where" in second
    assert "pass it to forward as an argument" not in first + second  # it already is one
