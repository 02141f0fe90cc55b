"""Tiny Hugging Face / vision models built from configs in code (nothing downloaded), each
wrapped in a module whose forward takes tensors and returns the loss (what `parallelize` and
`use_end2end` expect). Importable by spawned workers.

Every builder seeds torch, so the same name gives the same weights in every process; every
config turns dropout off (the parity tests compare element-wise; dropout is covered by the
random-stream tests).
"""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

VOCAB = 64
SEQ = 8
IMAGE = 16
CLASSES = 4


class CausalLM(torch.nn.Module):
    """GPT-2 / Llama: next-token loss from `input_ids` (and `attention_mask`, all ones unless the
    batch is padded)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, labels, attention_mask=None):
        logits = self.model(input_ids=input_ids, attention_mask=attention_mask).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


class PackedCausalLM(CausalLM):
    """A causal LM fed packed documents: `position_ids` restart at 0 where a document starts and
    there is no `attention_mask` (transformers then attends within each document)."""

    def forward(self, input_ids, labels, position_ids):
        logits = self.model(input_ids=input_ids, position_ids=position_ids).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _packed(build):
    def packed():
        model = build()
        model.__class__ = PackedCausalLM
        return model
    return packed


class MaskedLM(CausalLM):
    """BERT: the same token-level loss on the masked-LM head's logits."""


class Classifier(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, pixel_values, labels):
        logits = self.model(pixel_values=pixel_values).logits
        return F.cross_entropy(logits, labels)


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4,
                     bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager", use_cache=False)
    return CausalLM(GPT2LMHeadModel(cfg))


class MoeCausalLM(CausalLM):
    """Mixtral / Qwen2-MoE: the next-token loss plus the router's load-balancing loss over the whole
    batch, times `router_aux_loss_coef`. The loss is HF's formula (Switch Transformer's, as
    `load_balancing_loss_func`) computed in the logits' dtype: HF sums it in float32, whose rounding
    then depends on how a plan splits the tokens, so float64 parity would be held to float32's bar."""

    def forward(self, input_ids, labels, attention_mask=None):
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, output_router_logits=True)
        logits = out.logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        cfg = self.model.config
        experts = getattr(cfg, "num_local_experts", None) or cfg.num_experts
        aux = load_balancing_loss(out.router_logits, experts, cfg.num_experts_per_tok)
        return loss + cfg.router_aux_loss_coef * aux


def load_balancing_loss(router_logits, num_experts, top_k):
    """The fraction of tokens routed to each expert times its mean router probability, summed over
    experts and averaged over layers, times the number of experts (in the logits' dtype)."""
    logits = torch.cat(list(router_logits), dim=0)
    probs = torch.softmax(logits, dim=-1)
    _, chosen = torch.topk(probs, top_k, dim=-1)
    routed = F.one_hot(chosen, num_experts).to(probs.dtype)  # (tokens, k, experts)
    fraction = routed.mean(dim=0)
    return (fraction * probs.mean(dim=0).unsqueeze(0)).sum() * num_experts


def _same_dtype_rms_norm(model):
    """Llama's RMSNorm computes in float32 whatever the model's dtype (HF upcasts on purpose); its
    float32 rounding then depends on the tensor's layout (a tp plan that splits the batch differs
    from one process by ~1e-7). `llama64` swaps in the same formula computed in the input's
    dtype, so that float64 parity is element-wise."""
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon"):
            module.__class__ = _same_dtype_class(type(module))
    return model


_SAME_DTYPE = {}


_SOFTMAX_ROUTERS = ("MixtralTopKRouter", "Qwen2MoeTopKRouter", "Qwen3MoeTopKRouter")


def _same_dtype_router(model):
    """Mixtral's and Qwen-MoE's routers take their softmax in float32 whatever the model's dtype, so
    float64 runs carry float32 rounding that depends on the plan's summation order (a qwen3_moe
    hybrid case differed from one process by 1.2e-9). The same formula in the input's dtype keeps
    float64 parity element-wise, as `_same_dtype_rms_norm` does for RMSNorm."""
    for module in model.modules():
        if type(module).__name__ in _SOFTMAX_ROUTERS:
            cls = type(module)
            if cls not in _SAME_DTYPE:
                _SAME_DTYPE[cls] = type(f"SameDtype{cls.__name__}", (cls,),
                                        {"forward": _softmax_router_forward, "__module__": __name__})
            module.__class__ = _SAME_DTYPE[cls]
    return model


def _softmax_router_forward(self, hidden_states):
    """transformers' top-k softmax router (Mixtral, Qwen2/3-MoE) with the softmax in the input's dtype."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states, self.weight)
    top_value, top_index = torch.topk(torch.softmax(router_logits, dim=-1), self.top_k, dim=-1)
    if getattr(self, "norm_topk_prob", True):
        top_value = top_value / top_value.sum(dim=-1, keepdim=True)
    return router_logits, top_value, top_index




def _same_dtype_class(cls):
    if cls not in _SAME_DTYPE:
        def forward(self, hidden_states):
            variance = hidden_states.pow(2).mean(-1, keepdim=True)
            return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))
        _SAME_DTYPE[cls] = type(f"SameDtype{cls.__name__}", (cls,), {"forward": forward, "__module__": __name__})
    return _SAME_DTYPE[cls]


def llama64():
    return _same_dtype_rms_norm(llama())


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                      attention_dropout=0.0, attn_implementation="sdpa", use_cache=False)
    return CausalLM(LlamaForCausalLM(cfg))


def qwen2():
    """A tiny Qwen2 (grouped-query attention with q/k/v biases), RMSNorm in the input's dtype."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                      attention_dropout=0.0, attn_implementation="sdpa", use_cache=False)
    return _same_dtype_rms_norm(CausalLM(Qwen2ForCausalLM(cfg)))


def mistral():
    """A tiny Mistral: grouped-query attention with a sliding window (4 of the 8 positions), RMSNorm in
    the input's dtype."""
    from transformers import MistralConfig, MistralForCausalLM
    cfg = MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                        sliding_window=4, attention_dropout=0.0, attn_implementation="sdpa", use_cache=False)
    return _same_dtype_rms_norm(CausalLM(MistralForCausalLM(cfg)))


def mixtral(experts_implementation="eager"):
    """A tiny Mixtral: 4 experts, top-2, with the load-balancing loss (RMSNorm in the input's dtype,
    as `llama64`, so that float64 parity is element-wise)."""
    from transformers import MixtralConfig, MixtralForCausalLM
    cfg = MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                        max_position_embeddings=SEQ, attention_dropout=0.0, router_aux_loss_coef=0.02,
                        attn_implementation="sdpa", experts_implementation=experts_implementation, use_cache=False)
    return _same_dtype_router(_same_dtype_rms_norm(MoeCausalLM(MixtralForCausalLM(cfg))))


def qwen2_moe(experts_implementation="eager"):
    """A tiny Qwen2-MoE: 4 routed experts, top-2, a gated shared expert."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM
    cfg = Qwen2MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=24,
                         shared_expert_intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False,
                         max_position_embeddings=SEQ, attention_dropout=0.0, router_aux_loss_coef=0.02,
                         attn_implementation="sdpa", experts_implementation=experts_implementation, use_cache=False)
    return _same_dtype_router(_same_dtype_rms_norm(MoeCausalLM(Qwen2MoeForCausalLM(cfg))))


def qwen3_moe(experts_implementation="eager"):
    """A tiny Qwen3-MoE: 4 routed experts, top-2, q/k norms, no shared expert."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    cfg = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=24,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
                         num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=SEQ,
                         attention_dropout=0.0, router_aux_loss_coef=0.02, attn_implementation="sdpa",
                         experts_implementation=experts_implementation, use_cache=False)
    return _same_dtype_router(_same_dtype_rms_norm(MoeCausalLM(Qwen3MoeForCausalLM(cfg))))


def deepseek_v3(experts_implementation="eager"):
    """A tiny DeepSeek-V3: multi-head latent attention, one dense layer then one MoE layer of 8 routed
    experts (sigmoid scores, group-limited top-2: 2 groups, 1 kept per token, a nonzero
    ``e_score_correction_bias``) and a shared expert; no auxiliary loss. RMSNorm and the router in the
    input's dtype (transformers computes both in float32), so that float64 parity is element-wise."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    cfg = DeepseekV3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=24,
                           n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
                           first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
                           qk_nope_head_dim=8, v_head_dim=8, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=4, max_position_embeddings=SEQ, attention_dropout=0.0,
                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, attn_implementation="sdpa",
                           experts_implementation=experts_implementation, use_cache=False)
    model = DeepseekV3ForCausalLM(cfg)
    for module in model.modules():
        if type(module).__name__ == "DeepseekV3TopkRouter":
            module.__class__ = _same_dtype_deepseek_v3_router()
            module.e_score_correction_bias.copy_(torch.randn(module.num_experts) * 0.05)
    return _same_dtype_rms_norm(CausalLM(model))


def _deepseek_v3_router_forward(self, hidden_states):
    """transformers' DeepseekV3TopkRouter.forward with the logits in the input's dtype."""
    hidden_states = hidden_states.view(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states, self.weight.to(hidden_states.dtype))
    scores = router_logits.sigmoid()
    scores_for_choice = scores + self.e_score_correction_bias
    group_scores = scores_for_choice.view(-1, self.num_group, self.num_experts // self.num_group).topk(2, dim=-1)[0].sum(-1)
    group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, self.num_group, self.num_experts // self.num_group)
    scores_for_choice = scores_for_choice.masked_fill(~score_mask.reshape(-1, self.num_experts).bool(), float("-inf"))
    topk_indices = torch.topk(scores_for_choice, k=self.top_k, dim=-1, sorted=False)[1]
    topk_weights = scores.gather(1, topk_indices)
    if self.norm_topk_prob:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return router_logits, topk_weights * self.routed_scaling_factor, topk_indices


def _same_dtype_deepseek_v3_router():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    if DeepseekV3TopkRouter not in _SAME_DTYPE:
        _SAME_DTYPE[DeepseekV3TopkRouter] = type("SameDtypeDeepseekV3TopkRouter", (DeepseekV3TopkRouter,),
                                                 {"forward": _deepseek_v3_router_forward, "__module__": __name__})
    return _SAME_DTYPE[DeepseekV3TopkRouter]


def gpt_oss(experts_implementation="eager"):
    """A tiny gpt-oss: attention sinks, alternating sliding-window layers, 4 experts with biases and
    transposed weights, gpt-oss's clamped SwiGLU, top-2 after a softmax over the chosen logits; the
    load-balancing loss (as `MoeCausalLM`). RMSNorm in the input's dtype."""
    from transformers import GptOssConfig, GptOssForCausalLM
    cfg = GptOssConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=24, num_local_experts=4,
                       num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=8, sliding_window=4, max_position_embeddings=SEQ, attention_dropout=0.0,
                       router_aux_loss_coef=0.02, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                       attn_implementation="eager", experts_implementation=experts_implementation, use_cache=False)
    return _same_dtype_rms_norm(MoeCausalLM(GptOssForCausalLM(cfg)))


def bert():
    from transformers import BertConfig, BertForMaskedLM
    cfg = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0, attn_implementation="eager", use_cache=False)
    return MaskedLM(BertForMaskedLM(cfg))


def resnet():
    from transformers import ResNetConfig, ResNetForImageClassification
    cfg = ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                       layer_type="basic", num_labels=CLASSES)
    return Classifier(ResNetForImageClassification(cfg))


def vit():
    from transformers import ViTConfig, ViTForImageClassification
    cfg = ViTConfig(image_size=IMAGE, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
                    num_attention_heads=4, intermediate_size=64, num_labels=CLASSES,
                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attn_implementation="eager")
    return Classifier(ViTForImageClassification(cfg))


BUILDERS = {"gpt2": gpt2, "llama": llama, "llama64": llama64, "bert": bert, "resnet": resnet, "vit": vit,
            "mixtral": mixtral, "qwen2_moe": qwen2_moe, "qwen3_moe": qwen3_moe, "qwen2": qwen2, "mistral": mistral,
            "deepseek_v3": deepseek_v3, "gpt_oss": gpt_oss}
TEXT = ("gpt2", "llama", "llama64", "bert", "mixtral", "qwen2_moe", "qwen3_moe", "qwen2", "mistral", "deepseek_v3",
        "gpt_oss")
# the same models fed packed documents (`batch(name + "_packed", ...)`: position_ids, no attention_mask)
PACKED = ("llama64", "mistral", "gpt2")
BUILDERS.update({f"{name}_packed": _packed(BUILDERS[name]) for name in PACKED})
TEXT += tuple(f"{name}_packed" for name in PACKED)


def make(name, dtype=torch.float64, train=True):
    torch.manual_seed(0)
    model = BUILDERS[name]().to(dtype)
    return model.train(train)


def batch(name, step, n, dtype=torch.float64, pad=False):
    """The batch of `step` (the same in every process): `n` samples. With `pad` (True or "right"),
    every odd sample ends with 1..3 padding positions (attention_mask 0), so every data-parallel
    slice of an even size holds padding; with "left" they start with them instead; with "last" only
    the last sample ends with 2 (under dp 2 one rank's slice is padded, the other's not); "no-mask"
    gives no attention_mask at all."""
    g = torch.Generator().manual_seed(1000 + step)
    if name in TEXT:
        ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
        labels = torch.randint(0, VOCAB, (n, SEQ), generator=g)
        if pad == "no-mask":
            return {"input_ids": ids, "labels": labels}
        mask = torch.ones(n, SEQ, dtype=torch.long)
        if pad == "last":
            mask[n - 1, SEQ - 2:] = 0
        elif pad:
            for i in range(1, n, 2):
                mask[i, SEQ - 1 - (i // 2) % 3:] = 0
        if pad == "left":
            mask = mask.flip(-1)
        if name.endswith("_packed"):  # with `pad`, every odd sample holds two documents (2..4 tokens first)
            positions = torch.arange(SEQ).repeat(n, 1)
            if pad:
                for i in range(1, n, 2):
                    first = 2 + (i // 2) % 3
                    positions[i, first:] = torch.arange(SEQ - first)
            return {"input_ids": ids, "labels": labels, "position_ids": positions}
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}
    pixels = torch.randn(n, 3, IMAGE, IMAGE, generator=g, dtype=torch.float64).to(dtype)
    return {"pixel_values": pixels, "labels": torch.randint(0, CLASSES, (n,), generator=g)}
