"""The routed-experts op (nnscaler.ir.ops.moe) and the tracer's recognition of transformers'
experts modules (nnscaler.ir.tracer.moe_modules): the op computes what each family's experts
module computes, outputs and gradients, whatever its experts_implementation; the trace records
one op per experts module; what the op cannot express is refused naming the module."""
from __future__ import annotations

import pytest
import torch

from nnscaler.ir import TraceError, trace
from nnscaler.ir.ops.moe import ROUTED_EXPERTS, routed_experts
from nnscaler.ir.ops.registry import REGISTRY
from nnscaler.ir.tracer.moe_modules import _weights, experts_spec, is_transformers_experts

import moe_models

pytest.importorskip("transformers")


def _case(name, impl, dtype):
    torch.manual_seed(0)
    model = moe_models.build(name, impl).to(dtype)
    experts = moe_models.experts_modules(model)[0]
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.3)
    tokens, k = 12, 2
    num = experts.num_experts
    hidden = torch.randn(tokens, 32, dtype=dtype, requires_grad=True)
    index = torch.stack([torch.randperm(num)[:k] for _ in range(tokens)])
    index[0] = index[1]  # two tokens on the same experts
    weights = torch.rand(tokens, k, dtype=torch.float32, requires_grad=True)  # HF's routers give float32
    return experts, hidden, index, weights


@pytest.mark.parametrize("name", moe_models.FAMILIES)
@pytest.mark.parametrize("impl,dtype,tol", [("eager", torch.float64, 1e-12), ("batched_mm", torch.float64, 1e-12),
                                            ("grouped_mm", torch.float32, 2e-5)])
def test_routed_experts_equals_transformers(name, impl, dtype, tol):
    experts, hidden, index, weights = _case(name, impl, dtype)
    assert is_transformers_experts(experts)
    want = experts(hidden, index, weights)
    up, down, up_bias, down_bias = _weights(experts)
    got = routed_experts(hidden, index, weights, up, down, up_bias, down_bias, **experts_spec("x", experts))
    assert got.dtype == want.dtype and got.shape == want.shape
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() <= tol * scale
    inputs = [hidden, weights] + [p for p in (up, down, up_bias, down_bias) if p is not None]
    for a, b in zip(torch.autograd.grad(want.square().sum(), inputs), torch.autograd.grad(got.square().sum(), inputs)):
        assert (a - b).abs().max().item() <= tol * max(1.0, b.abs().max().item())


def test_specs_of_the_families():
    specs = {name: experts_spec(name, moe_models.experts_modules(moe_models.build(name))[0])
             for name in moe_models.FAMILIES}
    assert specs["mixtral"]["gate"] == "glu" and specs["mixtral"]["activation"] == "silu"
    assert specs["gpt_oss"]["gate"] == "clamped_swiglu" and specs["gpt_oss"]["transposed"]
    assert specs["gpt_oss"]["limit"] == 7.0


@pytest.mark.parametrize("name", moe_models.FAMILIES)
@pytest.mark.parametrize("impl", ["eager", "grouped_mm"])
def test_trace_records_one_op_per_experts_module(name, impl):
    torch.manual_seed(0)
    model = moe_models.build(name, impl)
    ids = torch.randint(0, 64, (2, 8))
    graph = trace(model, {"input_ids": ids})
    ops = [n for n in graph.nodes if n.target == ROUTED_EXPERTS]
    paths = [p for p, m in model.named_modules() if hasattr(m, "_is_expert_parallel")]
    assert [n.module_path for n in ops] == paths
    assert all(n.annotation.endswith("-> t h^") for n in ops)
    assert not any(n.module_path.rsplit(".", 1)[-1] == "experts" and n.target != ROUTED_EXPERTS for n in graph.nodes)
    assert "forward" not in vars(moe_models.experts_modules(model)[0])  # restored after the trace


def test_annotation_splits_tokens_only():
    anno = REGISTRY.lookup(routed_experts, (torch.zeros(4, 8), torch.zeros(4, 2, dtype=torch.long), torch.zeros(4, 2),
                                            torch.zeros(3, 6, 8), torch.zeros(3, 8, 3)), {})
    from nnscaler.ir import parse_annotation
    bound = parse_annotation(anno).bind([(4, 8), (4, 2), (4, 2), (3, 6, 8), (3, 8, 3)], [(4, 8)])
    assert bound.splittable_dims(2) == ["t"]


def test_top_k_above_experts_is_refused():
    with pytest.raises(ValueError, match="top-k = 3 .* only 2 experts"):
        routed_experts(torch.zeros(4, 8), torch.zeros(4, 3, dtype=torch.long), torch.zeros(4, 3),
                       torch.zeros(2, 6, 8), torch.zeros(2, 8, 3))


def test_unknown_gate_is_refused_naming_the_module():
    model = moe_models.build("mixtral")
    experts = moe_models.experts_modules(model)[0]
    type(experts)._apply_gate  # the default
    experts._apply_gate = lambda h: torch.relu(h[..., :h.shape[-1] // 2])
    with pytest.raises(TraceError, match=r"model\.layers\.0\.mlp\.experts .*MixtralExperts.*_apply_gate.*"
                                         r"nnscaler\.routed_experts"):
        trace(model, {"input_ids": torch.randint(0, 64, (2, 8))})


def test_post_expert_norm_is_refused():
    experts = moe_models.experts_modules(moe_models.build("mixtral"))[0]
    experts.has_post_expert_norm = True
    with pytest.raises(TraceError, match="has_post_expert_norm"):
        experts_spec("layers.0.mlp.experts", experts)


class MyExperts(torch.nn.Module):
    """A user's own MoE layer calling the op: traced as one op, as transformers' are."""

    def __init__(self):
        super().__init__()
        self.router = torch.nn.Linear(8, 4, bias=False)
        self.w1 = torch.nn.Parameter(torch.randn(4, 12, 8) * 0.3)
        self.w2 = torch.nn.Parameter(torch.randn(4, 8, 6) * 0.3)

    def forward(self, x):
        probs = self.router(x).softmax(-1)
        weights, index = probs.topk(2, dim=-1)
        import nnscaler
        return nnscaler.routed_experts(x, index, weights, self.w1, self.w2, activation="gelu").sum()


def test_own_module_calls_the_op():
    torch.manual_seed(0)
    model = MyExperts()
    x = torch.randn(6, 8)
    graph = trace(model, {"x": x})
    assert [n.target for n in graph.nodes].count(ROUTED_EXPERTS) == 1
    probs = model.router(x).softmax(-1)
    w, idx = probs.topk(2, dim=-1)
    want = sum(w[t, j] * (torch.nn.functional.gelu(x[t] @ model.w1[idx[t, j], :6].t()) * (x[t] @ model.w1[idx[t, j], 6:].t()))
               @ model.w2[idx[t, j]].t() for t in range(6) for j in range(2)).sum()
    assert torch.allclose(model(x), want, rtol=1e-5, atol=1e-5)


def _naive_capacity(hidden, index, weights, up, down, cf):
    """GShard's rule by hand: each expert keeps ceil(cf * T * k / E) pairs, first choices first, then
    tokens in order; a dropped pair adds nothing."""
    import math
    tokens, k = index.shape
    experts, ffn = up.shape[0], up.shape[1] // 2
    cap, used = math.ceil(cf * tokens * k / experts), [0] * experts
    out = torch.zeros_like(hidden)
    for s in range(k):
        for t in range(tokens):
            e = int(index[t, s])
            if used[e] < cap:
                used[e] += 1
                h = torch.nn.functional.silu(hidden[t] @ up[e, :ffn].t()) * (hidden[t] @ up[e, ffn:].t())
                out[t] += weights[t, s] * (h @ down[e].t())
    return out


@pytest.mark.parametrize("cf", [0.5, 1.0, 1.25, 100.0])
def test_capacity_drops_gshards_pairs(cf):
    g = torch.Generator().manual_seed(3)
    tokens, hidden_size, ffn, experts, k = 11, 6, 4, 4, 2
    hidden = torch.randn(tokens, hidden_size, generator=g, dtype=torch.float64)
    index = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    index[:6, 0] = 1  # expert 1 is every early token's first choice
    weights = torch.rand(tokens, k, generator=g, dtype=torch.float64)
    up = torch.randn(experts, 2 * ffn, hidden_size, generator=g, dtype=torch.float64)
    down = torch.randn(experts, hidden_size, ffn, generator=g, dtype=torch.float64)
    got = routed_experts(hidden, index, weights, up, down, capacity_factor=cf)
    assert (got - _naive_capacity(hidden, index, weights, up, down, cf)).abs().max().item() <= 1e-12
    assert torch.equal(got, routed_experts(hidden, index, weights, up, down)) == (cf == 100.0)


def test_capacity_keeps_the_tokens_whole_and_is_checked():
    from nnscaler.ir import parse_annotation
    args = (torch.zeros(4, 8), torch.zeros(4, 2, dtype=torch.long), torch.zeros(4, 2), torch.zeros(3, 6, 8),
            torch.zeros(3, 8, 3))
    anno = REGISTRY.lookup(routed_experts, args, {"capacity_factor": 1.25})
    bound = parse_annotation(anno).bind([(4, 8), (4, 2), (4, 2), (3, 6, 8), (3, 8, 3)], [(4, 8)])
    assert bound.splittable_dims(2) == []  # which pairs drop depends on the whole batch
    for bad in (0, -1.0, "1.25", True):
        with pytest.raises(ValueError, match=r"capacity_factor must be a number > 0 .* None for dropless"):
            routed_experts(*args, capacity_factor=bad)


def test_set_capacity_factor_reaches_the_traced_op():
    from nnscaler.ir import experts_recorded_whole, set_capacity_factor
    torch.manual_seed(0)
    model = moe_models.build("mixtral")
    ids = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        dropless = model(input_ids=ids).logits
    assert set_capacity_factor(model, 0.5) == 2  # one experts module per layer
    ops = [n for n in trace(model, {"input_ids": ids}).nodes if n.target == ROUTED_EXPERTS]
    assert [n.kwargs.get("capacity_factor") for n in ops] == [0.5, 0.5] and all(" t^ " in f" {n.annotation} " for n in ops)
    with torch.no_grad(), experts_recorded_whole(model):  # one process: the op, with its capacity
        dropped = model(input_ids=ids).logits
    assert not torch.allclose(dropped, dropless)
    set_capacity_factor(model, None)
    with torch.no_grad(), experts_recorded_whole(model):
        assert torch.allclose(model(input_ids=ids).logits, dropless, atol=1e-5)
