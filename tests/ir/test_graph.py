"""IRGraph: JSON round trip of traced models, encoding of special constants, fingerprint,
queries (producers/consumers) and helpers."""
import json
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from nnscaler.ir import IRGraph, Node, Ref, SourceLoc, trace
from nnscaler.ir.graph import decode, encode, iter_refs, map_refs

torch.manual_seed(0)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

    def forward(self, x):
        return self.layers(x).softmax(-1)


class Attention(nn.Module):
    def __init__(self, d=8, heads=2):
        super().__init__()
        self.heads, self.ln, self.qkv, self.out = heads, nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x, mask):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln(x)).chunk(3, dim=-1)
        q, k, v = (t.reshape(B, T, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-1, -2)).masked_fill(mask[:, None, None, :], float("-inf"))
        y = att.softmax(-1) @ v
        return x + self.out(y.transpose(1, 2).reshape(B, T, C))


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.fc = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.Linear(64, 10)

    def forward(self, img):
        h = F.max_pool2d(F.relu(self.bn(self.conv(img))), 2)
        return self.fc(torch.flatten(h, 1))


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight
        self.frozen = nn.Linear(4, 4).requires_grad_(False)
        self.register_buffer("b", torch.ones(4), persistent=False)
        self.const = torch.linspace(0, 1, 4)

    def forward(self, batch, scale=0.5):
        h = self.frozen(self.emb(batch["ids"])) * scale + self.b + self.const
        h = h.clone()
        h[..., 0] = batch["extra"][0]
        h.relu_()
        return {"logits": self.head(h), "shape": (h.shape[0], h.shape[1:])}


class Slicer(nn.Module):
    def forward(self, x):
        y = x[:, 1:3].to(torch.float64).to(dtype=torch.float32, device=torch.device("cpu"))
        z = x.reshape(x.size())[..., :x.size(-1) // 2]
        w = x.to(memory_format=torch.contiguous_format).clamp(min=-math.inf, max=math.inf)
        return y, z, w.view(x.shape)


def _mask():
    m = torch.zeros(2, 5, dtype=torch.bool)
    m[:, -1] = True
    return m


MODELS = {
    "mlp": (MLP, lambda: {"x": torch.randn(2, 8)}),
    "attention": (Attention, lambda: {"x": torch.randn(2, 5, 8), "mask": _mask()}),
    "cnn": (CNN, lambda: {"img": torch.randn(2, 3, 8, 8)}),
    "tied": (Tied, lambda: {"batch": {"ids": torch.tensor([[1, 2], [3, 4]]), "extra": [torch.randn(2, 2)]}}),
    "slicer": (Slicer, lambda: {"x": torch.randn(3, 4)}),
}


def round_trip(g: IRGraph) -> IRGraph:
    text = json.dumps(g.to_json(), allow_nan=False)  # strict JSON: inf/nan are tagged, not bare
    return IRGraph.from_json(json.loads(text))


@pytest.mark.parametrize("constant_folding", [False, True])
@pytest.mark.parametrize("name", list(MODELS))
def test_json_round_trip(name, constant_folding):
    cls, args = MODELS[name]
    g = trace(cls(), args(), constant_folding=constant_folding)
    g2 = round_trip(g)
    assert g2.fingerprint() == g.fingerprint()
    assert g2.summary() == g.summary()
    assert g2.nodes == g.nodes  # targets, args, outputs, module paths, sources, flags
    assert g2.values == g.values and g2.output == g.output
    assert g2.params == g.params and g2.buffers == g.buffers and g2.constants == g.constants
    assert g2.inputs == g.inputs and g2.constant_folding is constant_folding
    assert round_trip(g2).to_json() == g.to_json()
    assert g.summary().splitlines()[0] == (f"IRGraph of {cls.__module__}.{cls.__qualname__}: {len(g.nodes)} ops, "
                                           f"{len(g.params)} params, {len(g.buffers)} buffers")


def test_round_trip_keeps_the_details():
    g = round_trip(trace(Tied(), MODELS["tied"][1]()))
    assert g.params["emb.weight"].aliases == ["head.weight"]
    assert not g.params["frozen.weight"].requires_grad and g.params["emb.weight"].requires_grad
    assert g.buffers["b"].persistent is False
    assert list(g.constants) == ["_constant_0"] and g.constants["_constant_0"].shape == (4,)
    assert [p for p, _ in g.inputs[0].leaves] == [("ids",), ("extra", 0)]
    assert g.inputs[1].default == 0.5 and not g.inputs[1].traced
    assert isinstance(g.output, dict) and isinstance(g.output["shape"], tuple)
    assert isinstance(g.output["shape"][1], tuple) and all(isinstance(r, Ref) for r in g.output["shape"][1])
    setitem = next(n for n in g.nodes if n.target == "torch.Tensor.__setitem__")
    assert setitem.inplace and setitem.args[1] == (Ellipsis, 0)
    assert all(isinstance(v.shape, tuple) for v in g.values.values() if v.is_tensor)


def test_round_trip_special_args():
    g = round_trip(trace(Slicer(), {"x": torch.randn(3, 4)}))
    args = {n.id: n.args for n in g.nodes}
    kwargs = {n.id: n.kwargs for n in g.nodes}
    flat = [a for n in g.nodes for a in list(iter_refs(n.args)) + [x for x in n.args if not isinstance(x, Ref)]]
    assert any(a == (slice(None), slice(1, 3)) for a in flat)
    assert torch.float64 in flat
    assert {"dtype": torch.float32, "device": torch.device("cpu")} in kwargs.values()
    assert {"memory_format": torch.contiguous_format} in kwargs.values()
    clamp = next(n for n in g.nodes if n.target == "torch.Tensor.clamp")
    assert clamp.kwargs == {"min": -math.inf, "max": math.inf}
    sliced = [a for a in args.values() if len(a) == 2 and isinstance(a[1], tuple) and a[1][0] is Ellipsis
              and isinstance(a[1][1], slice)]
    assert len(sliced) == 1 and isinstance(sliced[0][1][1].stop, Ref)  # x.size(-1) // 2 stays symbolic


@pytest.mark.parametrize("obj", [
    slice(1, None, 2), (slice(None), Ellipsis, None), Ellipsis, torch.float16, torch.bfloat16,
    torch.device("cuda:1"), torch.device("cpu"), math.inf, -math.inf, torch.Size([2, 3]), torch.Size([]),
    {"a": (1, [2, {"b": (3,)}]), 4: "int key", (1, 2): "tuple key"}, [1, 2.5, "s", True, None],
    3 + 4j, torch.channels_last, torch.strided, Ref(7), {"$ref": 1}, (), [], {},
])
def test_encode_decode(obj):
    data = encode(obj)
    back = decode(json.loads(json.dumps(data, allow_nan=False)))
    assert back == obj and type(back) is type(obj)


def test_encode_decode_nan_and_types():
    back = decode(json.loads(json.dumps(encode([float("nan"), True, 1, 1.0]))))
    assert math.isnan(back[0]) and [type(x) for x in back[1:]] == [bool, int, float]
    assert encode((1,)) != encode([1])
    assert encode(torch.Size([1])) != encode((1,))


@pytest.mark.parametrize("bad", [object(), {1, 2}, torch.nn.Linear(1, 1), lambda: 0])
def test_encode_rejects_unrecordable_constants(bad):
    with pytest.raises(TypeError, match="cannot record constant of type"):
        encode(bad)


def test_decode_rejects_unknown_tags():
    with pytest.raises(ValueError, match=r"\$bogus"):
        decode({"$bogus": 1})


def test_fingerprint_ignores_source_but_not_program():
    g = trace(MLP(), {"x": torch.randn(2, 8)})
    fp = g.fingerprint()
    assert len(fp) == 16
    data = g.to_json()
    for n in data["nodes"]:
        n["source"] = ["/elsewhere.py", 999, "other code", "f"]
    assert IRGraph.from_json(data).fingerprint() == fp
    changed = g.to_json()
    changed["nodes"][0]["target"] = "torch.nn.functional.bilinear"
    assert IRGraph.from_json(changed).fingerprint() != fp
    changed = g.to_json()
    changed["values"][-1][3] = [3, 4]
    assert IRGraph.from_json(changed).fingerprint() != fp
    assert trace(MLP(), {"x": torch.randn(3, 8)}).fingerprint() != fp
    assert trace(MLP(), {"x": torch.randn(2, 8)}, constant_folding=True).fingerprint() != fp


def test_producers_consumers_and_queries():
    g = trace(MLP(), {"x": torch.randn(2, 8)})
    prod, cons = g.producers(), g.consumers()
    x_ref = g.inputs[0].leaves[0][1]
    assert x_ref.id not in prod and [n.target for n in cons[x_ref.id]] == ["torch.nn.functional.linear"]
    for n in g.nodes:
        for r in n.output_refs():
            assert prod[r.id] is n
    assert g.output.id not in cons
    w = g.params["layers.0.weight"].value
    assert cons[w.id] == [g.nodes[0]]
    assert g.value(g.output).shape == (2, 4) and g.value(g.output).is_tensor
    assert [s.name for s in g.tensor_specs()] == list(g.params)
    assert g.nodes[0].short_name == "linear"


def test_node_and_source_descriptions():
    src = SourceLoc("/a/b/model.py", 12, "y = f(x)", "M.forward")
    assert src.short() == "model.py:12"
    assert str(src) == "/a/b/model.py:12 in M.forward: y = f(x)"
    assert str(SourceLoc("/m.py", 3)) == "/m.py:3"
    n = Node(0, "torch.relu", [Ref(1)], {}, Ref(2), "blocks.0", src)
    assert n.describe() == "torch.relu (module blocks.0) at /a/b/model.py:12 in M.forward: y = f(x)"
    assert Node(1, "torch.relu", [], {}, None).describe() == "torch.relu"
    assert n.input_refs() == [Ref(1)] and n.output_refs() == [Ref(2)]


def test_iter_and_map_refs():
    nested = [Ref(1), (2, {"k": Ref(3)}), slice(Ref(4), None, Ref(5)), "s"]
    assert [r.id for r in iter_refs(nested)] == [1, 3, 4, 5]
    mapped = map_refs(nested, lambda r: Ref(r.id * 10))
    assert mapped == [Ref(10), (2, {"k": Ref(30)}), slice(Ref(40), None, Ref(50)), "s"]
    assert type(mapped[1]) is tuple
    assert nested[0] == Ref(1)  # the original is left as it was
