"""autodist's activation memory (`cost_model.saved_for_backward`) against what autograd really
keeps: the distinct storages the backward graph saves, walked after a real forward, on our GPT
and tiny Hugging Face models (fp32), and on the patterns each rule is for."""
from __future__ import annotations

import os
import sys

import pytest
import torch

import gpt
from nnscaler.ir import trace
from nnscaler.policies.autodist.cost_model import nbytes, saved_for_backward
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


def _hf(name):
    model = hf_models.make(name, dtype=torch.float32)
    batch = hf_models.batch(name, 0, 4, dtype=torch.float32)
    # no attention_mask: with one, HF's mask decision is traced both ways and the estimate counts
    # the ops of both branches (conservative, docs/autodist.md)
    return model, {k: v for k, v in batch.items() if k != "attention_mask"}


def _gpt():
    cfg = gpt.GPTConfig(n_layer=2, n_embd=64, n_head=4, block_size=32, vocab_size=128)
    torch.manual_seed(0)
    return gpt.GPT(cfg).train(), gpt.random_batch(0, 4, cfg)


@pytest.mark.parametrize("build", [_gpt, lambda: _hf("llama"), lambda: _hf("llama64")], ids=["gpt", "llama", "llama64"])
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
