"""Multi-head latent attention (DeepSeek-V2/V3) in ``nnscaler plan estimate``: its widths read from the
config, its projections through the latents counted as the real module's, its cost (the q/k and v head
widths in attention's FLOPs, the down-projections replicated over tp) and its model FLOPs. Configs are
written to a temp dir: nothing downloads."""
from __future__ import annotations

import json

import pytest
import torch

from nnscaler.policies.estimate import ModelConfigError, ModelSpec, Plan, Workload, estimate_plan, parse_cluster
from nnscaler.policies.estimate.layer_times import layer_times

# DeepSeek-V2's shape, small: q through a 32-wide latent, k and v through a 16-wide one, an 8-wide rope key
MLA = {"model_type": "deepseek_v2", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
       "num_key_value_heads": 4, "intermediate_size": 96, "moe_intermediate_size": 32, "n_routed_experts": 8,
       "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1, "q_lora_rank": 32,
       "kv_lora_rank": 16, "qk_nope_head_dim": 24, "qk_rope_head_dim": 8, "v_head_dim": 16, "vocab_size": 128,
       "max_position_embeddings": 64}
LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 128, "max_position_embeddings": 64}
PEAK = 100e12
# no SM count (no GEMM shapes) and a memory so fast that only FLOPs take time: a layer's time is its FLOPs
FLOPS_ONLY = parse_cluster({"gpu": {"name": "flops-only", "bf16_tflops": PEAK / 1e12, "memory_gb": 80,
                                    "memory_gbps": 1e12}, "gpus_per_node": 8,
                            "intra_node": {"gbps": 100, "latency_us": 1}, "inter_node": {"gbps": 10, "latency_us": 1}},
                           "flops-only.yaml")


def spec_of(tmp_path, raw, name="config.json"):
    path = tmp_path / name
    path.write_text(json.dumps(raw))
    return ModelSpec.from_hf_config(path)


def attention_module_params(raw) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**raw))
    return sum(p.numel() for p in model.model.layers[0].self_attn.parameters())


@pytest.mark.parametrize("q_lora", [32, None])  # V2 / V3 (q through a latent) and V2-Lite (q projected directly)
def test_mla_widths_and_projections_are_the_real_modules(tmp_path, q_lora):
    raw = dict(MLA, q_lora_rank=q_lora)
    spec = spec_of(tmp_path, raw)
    assert spec.is_mla and (spec.q_lora_rank, spec.kv_lora_rank, spec.rope_dim, spec.qk_dim, spec.v_dim) == \
        (q_lora or 0, 16, 8, 32, 16)
    assert spec.kv_heads == spec.heads and spec.attn_dim == 24  # QKᵀ over 32, PV over 16
    norms = (q_lora or 0) + 16  # the latents' RMSNorms
    assert spec.attn_params + norms == attention_module_params(raw)


def test_standard_attention_is_unchanged(tmp_path):
    spec = spec_of(tmp_path, LLAMA)
    h, a, kv, d = 64, 4, 2, 16
    assert not spec.is_mla and spec.attn_dim == d
    assert spec.attn_params == h * d * (2 * a + 2 * kv) == attention_module_params(LLAMA)
    assert spec.act_elements_per_token() == 4 * h + (2 * a + 2 * kv) * d + 4 * 96


@pytest.mark.parametrize("tp", [1, 2])
def test_mla_layer_time_is_its_flops(tmp_path, tp):
    spec = spec_of(tmp_path, MLA)
    b, s, h, a = 2, 64, 64, 4
    m = b * s
    # down-projections to the latents on every tp rank; the up-projections and the output split over tp
    down = 2 * m * (h * 32 + h * (16 + 8))
    up = 2 * m * (32 * a * 32 + 16 * a * (24 + 16) + a * 16 * h) / tp
    mlp = 2 * m * 3 * h * 96 / tp  # the dense layer's gated MLP
    attention = 2 * b * s * s * (a / tp) * (32 + 16) * 0.5  # QKᵀ and PV, causal
    fwd, bwd, _, _ = layer_times(spec, b, s, tp, FLOPS_ONLY)
    want = (down + up + mlp) / (PEAK * 0.8) + attention / (PEAK * 0.5)
    assert fwd == pytest.approx(want, rel=1e-4)
    assert bwd == pytest.approx(2 * (down + up + mlp) / (PEAK * 0.8) + 2.5 * attention / (PEAK * 0.5), rel=1e-4)


def test_mla_model_flops_count_both_head_widths(tmp_path):
    spec = spec_of(tmp_path, MLA)
    work = Workload(8, 64, 64 * 64)
    est = estimate_plan(spec, FLOPS_ONLY, work, Plan(tp=1, pp=1, dp=8, zero=0, micro_batch=1, recompute=False))
    tokens = work.global_batch_tokens
    assert est.model_flops == pytest.approx(6 * spec.active_params * tokens + 6 * 2 * 4 * (32 + 16) * 64 * tokens)


def test_bad_mla_config_names_the_field(tmp_path):
    with pytest.raises(ModelConfigError, match="bad.json: 'v_head_dim' must be a whole number >= 1 with "
                                               "'kv_lora_rank' set"):
        spec_of(tmp_path, dict(MLA, v_head_dim=0), "bad.json")
