"""The `megatron` policy's default patterns on real module layouts (our example GPT, Hugging Face
GPT-2 / Llama / BERT / ViT, traced from tiny configs), and its warnings when patterns match
nothing. Planning only (no processes); parity is in tests/models and tests/runtime."""
from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch

from nnscaler.ir import ComputeConfig, trace
from nnscaler.policies.builtin.megatron import MegatronPatternWarning, megatron_policy

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models"))
import hf_models  # noqa: E402


def _plan(model, args, **pas):
    graph = trace(model, args, trace_strategy="cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        megatron_policy(graph, ComputeConfig(2, 2, pas_config=pas))
    return graph, [w for w in caught if issubclass(w.category, MegatronPatternWarning)]


def _split(graph):
    """{module path: split dim} of the projections (linear / addmm), and of every split op."""
    proj, ops = {}, {}
    for node in graph.nodes:
        dim = node.pieces[0].dim if node.pieces else None
        if node.short_name in ("linear", "addmm"):
            proj[node.module_path] = dim
        if dim is not None:
            ops.setdefault(node.short_name, set()).add(dim)
    return proj, ops


EXPECTED = {  # layer 0's projections: column-parallel (n), row-parallel (k), replicated (None)
    "gpt2": {"attn.c_attn": None, "attn.c_proj": "k", "mlp.c_fc": "n", "mlp.c_proj": "k"},
    "llama": {"self_attn.q_proj": "n", "self_attn.k_proj": "n", "self_attn.v_proj": "n", "self_attn.o_proj": "k",
              "mlp.gate_proj": "n", "mlp.up_proj": "n", "mlp.down_proj": "k"},
    "bert": {"attention.self.query": "n", "attention.self.key": "n", "attention.self.value": "n",
             "attention.output.dense": "k", "intermediate.dense": "n", "output.dense": "k"},
    "vit": {"attention.q_proj": "n", "attention.k_proj": "n", "attention.v_proj": "n", "attention.o_proj": "k",
            "mlp.fc1": "n", "mlp.fc2": "k"},
}
LAYER0 = {"gpt2": "model.transformer.h.0.", "llama": "model.model.layers.0.", "bert": "model.bert.encoder.layer.0.",
          "vit": "model.vit.layers.0."}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_default_patterns_split_hf_projections(name):
    graph, caught = _plan(hf_models.make(name), hf_models.batch(name, 0, 2))
    proj, ops = _split(graph)
    got = {path[len(LAYER0[name]):]: dim for path, dim in proj.items() if path.startswith(LAYER0[name])}
    assert got == EXPECTED[name]
    assert not caught
    # attention itself runs on each device's heads: its matmuls / SDPA are split, not replicated
    attention = ops.get("scaled_dot_product_attention", set()) | ops.get("matmul", set())
    assert attention, ops
    if name == "llama":  # grouped-query attention: split by the kv heads (h); where HF repeats the kv
        # heads itself (the padded-mask branch) SDPA sees equal head counts, split along them (_1)
        assert "h" in ops["scaled_dot_product_attention"] <= {"h", "_1"}


def test_gpt2_fused_qkv_is_split_by_heads_after_the_projection():
    graph, _ = _plan(hf_models.make("gpt2"), hf_models.batch("gpt2", 0, 2))
    heads = [n for n in graph.nodes if n.module_path == "model.transformer.h.0.attn" and n.short_name == "view"
             and n.pieces and n.pieces[0].dim is not None]
    assert len(heads) == 3  # q, k and v, each split by heads after the replicated c_attn


class Plain(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(8, 16)
        self.down = torch.nn.Linear(16, 8)

    def forward(self, x):
        return self.down(torch.relu(self.up(x))).sum()


def test_no_projection_split_warns_with_the_module_paths():
    graph, caught = _plan(Plain(), {"x": torch.randn(4, 8)})
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "splits no projection" in message and "down, up" in message and "pas_config" in message
    assert caught[0].filename == __file__  # attributed to the user's call (here: this test)


def test_warning_class_is_public_and_a_policy_warning():
    from nnscaler.policies import MegatronPatternWarning as exported, PolicyWarning
    assert exported is MegatronPatternWarning and issubclass(exported, PolicyWarning)
    assert issubclass(exported, UserWarning)


def test_configured_pattern_matching_nothing_warns():
    graph, caught = _plan(Plain(), {"x": torch.randn(4, 8)}, column=["*up", "*.mlp.fc1"], row=["down"])
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and "['*.mlp.fc1']" in messages[0] and "column" in messages[0]
    assert "down, up" in messages[0]
    proj, _ = _split(graph)
    assert proj == {"up": "n", "down": "k"}
