"""Tiny transformers mixture-of-experts models built from configs in code (nothing downloaded):
one per experts family nnscaler recognises."""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROPE = {"rope_type": "default", "rope_theta": 10000.0}
FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "gpt_oss")


def build(name: str, impl: str = "eager", **overrides):
    """A 2-layer causal LM of family `name` whose experts run `impl` (eager, grouped_mm, batched_mm)."""
    import transformers as T
    common = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=16, use_cache=False, experts_implementation=impl)
    common.update(overrides)
    if name == "mixtral":
        return T.MixtralForCausalLM(T.MixtralConfig(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
                                                    **common))
    if name == "qwen2_moe":
        return T.Qwen2MoeForCausalLM(T.Qwen2MoeConfig(intermediate_size=48, moe_intermediate_size=24,
                                                      shared_expert_intermediate_size=40, num_experts=4,
                                                      num_experts_per_tok=2, **common))
    if name == "qwen3_moe":
        return T.Qwen3MoeForCausalLM(T.Qwen3MoeConfig(intermediate_size=48, moe_intermediate_size=24, num_experts=4,
                                                      num_experts_per_tok=2, head_dim=8, **common))
    if name == "deepseek_v3":  # sigmoid, group-limited top-k routing, a shared expert, one dense layer first
        return T.DeepseekV3ForCausalLM(T.DeepseekV3Config(
            intermediate_size=48, moe_intermediate_size=24, n_routed_experts=8, n_shared_experts=1,
            num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=16,
            kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, rope_parameters=ROPE,
            **{**common, "num_key_value_heads": 4}))
    if name == "gpt_oss":  # transposed weights with biases, interleaved clamped SwiGLU
        return T.GptOssForCausalLM(T.GptOssConfig(intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
                                                  head_dim=8, sliding_window=8, rope_parameters=ROPE, **common))
    raise KeyError(name)


def experts_modules(model):
    return [m for m in model.modules() if hasattr(m, "_is_expert_parallel")]
