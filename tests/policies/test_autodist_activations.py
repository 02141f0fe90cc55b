"""autodist's activation memory (`activations.saved_for_backward`) against what autograd really
keeps: the distinct storages the backward graph saves, walked after a real forward, on our GPT
and tiny Hugging Face models (fp32), and on the patterns each rule is for."""
from __future__ import annotations

import os
import sys

import pytest
import torch

import gpt
from nnscaler.ir import trace
from nnscaler.policies.autodist.activations import saved_for_backward
from nnscaler.policies.autodist.cost_model import nbytes
from nnscaler.policies.plan import tensor_outputs

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models"))
import hf_models  # noqa: E402


def estimated_bytes(model, batch) -> float:
    graph = trace(model, batch)
    kept = saved_for_backward(graph)
    return sum(nbytes(graph.value(r).shape, graph.value(r).dtype)
               for node in graph.nodes for r in tensor_outputs(graph, node)
               if r.id in kept and graph.value(r).requires_grad and graph.value(r).dtype in ("float32", "float64"))


def real_bytes(model, batch) -> float:
    """Bytes of the distinct floating storages autograd saved for backward, not counting the
    module's parameters and buffers or the batch (held whatever the plan)."""
    out = model(**batch)
    params = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers(), *batch.values()]}
    seen, todo, done = {}, [out.grad_fn], set()
    while todo:
        fn = todo.pop()
        if fn is None or fn in done:
            continue
        done.add(fn)
        for name in dir(fn):
            if not name.startswith("_saved_"):
                continue
            try:
                value = getattr(fn, name)
            except Exception:  # a saved value freed or not a tensor
                continue
            for t in value if isinstance(value, (tuple, list)) else [value]:
                if torch.is_tensor(t) and t.is_floating_point():
                    key = t.untyped_storage().data_ptr()
                    if key not in params:
                        seen[key] = t.untyped_storage().nbytes()
        todo.extend(f for f, _ in fn.next_functions)
    return float(sum(seen.values()))


def _hf(name, mask=False):
    """Without `mask` transformers 5 decides in Python whether the position ids pack several
    sequences, with one whether the mask pads anything: either way both branches are traced (a
    second SDPA call with a 4-D mask), and only one of them runs."""
    model = hf_models.make(name, dtype=torch.float32)
    batch = hf_models.batch(name, 0, 4, dtype=torch.float32)
    return model, {k: v for k, v in batch.items() if mask or k != "attention_mask"}


def _gpt():
    cfg = gpt.GPTConfig(n_layer=2, n_embd=64, n_head=4, block_size=32, vocab_size=128)
    torch.manual_seed(0)
    return gpt.GPT(cfg).train(), gpt.random_batch(0, 4, cfg)


@pytest.mark.parametrize("build", [_gpt, lambda: _hf("llama"), lambda: _hf("llama64"), lambda: _hf("llama", mask=True)],
                         ids=["gpt", "llama", "llama64", "llama-mask"])
def test_activation_estimate_matches_what_autograd_keeps(build):
    model, batch = build()
    est, real = estimated_bytes(model, batch), real_bytes(model, batch)
    assert real > 0
    assert est == pytest.approx(real, rel=0.02), (est, real)


class ScaledByConstant(torch.nn.Module):
    """Rotary's pattern: x * (a tensor that needs no gradient) keeps only that tensor."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.register_buffer("cos", torch.rand(16))

    def forward(self, x):
        h = self.lin(x)
        shape = h.shape  # a shape query keeps nothing
        return (h * self.cos).sum() + shape[0]


class AttentionOutput(torch.nn.Module):
    """sdpa(...).transpose(1, 2).contiguous(): the kernel's output is laid out so that the copy is free."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(32, 32)

    def forward(self, x):
        q = self.proj(x).view(x.shape[0], x.shape[1], 4, 8).transpose(1, 2)  # (batch, heads, seq, dim) view
        y = torch.nn.functional.scaled_dot_product_attention(q, q, q)
        y = y.transpose(1, 2).contiguous().reshape(x.shape[0], x.shape[1], -1)
        return self.proj(y).sum()


@pytest.mark.parametrize("model,batch", [
    (ScaledByConstant(), {"x": torch.randn(8, 16)}),
    (AttentionOutput(), {"x": torch.randn(2, 8, 32)}),
], ids=["mul-by-constant", "sdpa-transpose-contiguous"])
def test_each_rule_matches_autograd(model, batch):
    est, real = estimated_bytes(model, batch), real_bytes(model, batch)
    # sdpa also keeps its softmax's log-sum-exp: 1/head_dim of its output (1/8 here), not an op output
    assert est == pytest.approx(real, rel=0.07), (est, real)


class TwoWays(torch.nn.Module):
    """A decision on a tensor's value: the tracer keeps both branches, a step runs one."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x):
        h = self.lin(x)
        if x.mean() > 0:
            h = torch.exp(h)  # keeps one output
        else:
            h = torch.exp(torch.exp(h) * 2)  # keeps two
        return h.sum()


@pytest.mark.parametrize("sign", [1, -1], ids=["traced-light", "traced-heavy"])
def test_a_traced_branch_counts_the_heavier_side_only(sign):
    torch.manual_seed(0)
    model = TwoWays()
    light, heavy = {"x": torch.rand(8, 16) + 1}, {"x": -torch.rand(8, 16) - 1}
    graph = trace(model, light if sign > 0 else heavy)
    assert any(node.branch is not None for node in graph.nodes)  # both branches are in the graph
    assert real_bytes(model, light) < real_bytes(model, heavy)
    # whichever branch the trace took, the estimate is the heavier branch's, not the sum of both
    assert estimated_bytes(model, light if sign > 0 else heavy) == real_bytes(model, heavy)


class TwoLinears(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(32, 64)
        self.b = torch.nn.Linear(64, 32)

    def forward(self, x):
        return self.b(self.a(x)).sum()


def test_a_converted_copy_the_consumer_keeps_is_memory_of_the_edge():
    """a's output split over 2 devices, b replicated: b keeps the all-gathered (whole) hidden for
    its weight gradient, on top of a's shard; the same layout on both sides costs nothing more."""
    from nnscaler.ir import ComputeConfig
    from nnscaler.policies.autodist import AutodistConfig
    from nnscaler.policies.autodist.comm_model import CommModel
    from nnscaler.policies.autodist.policy import _Search
    comm = {"backend": "given", "collectives": {c: {"2": [1e-5, 5e9]} for c in
                                                ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")}}
    graph = trace(TwoLinears(), {"x": torch.randn(8, 32, requires_grad=True)})
    cfg = AutodistConfig.from_compute_config(ComputeConfig(2, 2, pas_config={"_comm_profile": comm,
                                                                             "_profile_repeats": 1}))
    problem = _Search(graph, cfg).problem(2, CommModel(comm))
    ua = next(i for i, op in enumerate(problem.ops) if op.node.module_path == "a")
    vb = next(i for i, op in enumerate(problem.ops) if op.node.module_path == "b")
    (edge,) = [e for e in problem.edges if (e.u, e.v) == (ua, vb)]
    labels_a, labels_b = problem.ops[ua].labels, problem.ops[vb].labels
    hidden = 8 * 64 * 4
    split_a = labels_a.index("n")  # a's output columns split
    whole_b = labels_b.index("R")
    assert edge.mem[split_a, whole_b] == hidden
    assert edge.mem[labels_a.index("R"), whole_b] == 0  # same layout: no copy
    pick = [0] * len(problem.ops)
    pick[ua], pick[vb] = split_a, whole_b
    _, with_copy = problem.evaluate(pick)
    pick[ua] = labels_a.index("R")
    _, without = problem.evaluate(pick)
    op_a = problem.ops[ua]
    # the estimate counts the copy on top of what a's choice itself costs
    assert with_copy - without == pytest.approx(hidden + op_a.mem[split_a] - op_a.mem[labels_a.index("R")])
