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


def _same_dtype_rms_norm(model):
    """Llama's RMSNorm computes in float32 whatever the model's dtype (HF upcasts on purpose); its
    float32 rounding then depends on the tensor's layout (a tp plan that splits the batch differs
    from one process by ~1e-7). `llama64` swaps in the same formula computed in the input's
    dtype, so that float64 parity is element-wise."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    class SameDtypeRMSNorm(LlamaRMSNorm):
        def forward(self, hidden_states):
            variance = hidden_states.pow(2).mean(-1, keepdim=True)
            return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))

    for module in model.modules():
        if type(module) is LlamaRMSNorm:
            module.__class__ = SameDtypeRMSNorm
    return model


def llama64():
    return _same_dtype_rms_norm(llama())


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                      attention_dropout=0.0, attn_implementation="sdpa", use_cache=False)
    return CausalLM(LlamaForCausalLM(cfg))


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


BUILDERS = {"gpt2": gpt2, "llama": llama, "llama64": llama64, "bert": bert, "resnet": resnet, "vit": vit}
TEXT = ("gpt2", "llama", "llama64", "bert")


def make(name, dtype=torch.float64, train=True):
    torch.manual_seed(0)
    model = BUILDERS[name]().to(dtype)
    return model.train(train)


def batch(name, step, n, dtype=torch.float64, pad=False):
    """The batch of `step` (the same in every process): `n` samples. With `pad`, every odd sample
    ends with 1..3 padding positions (attention_mask 0), so every data-parallel slice of an even
    size holds padding."""
    g = torch.Generator().manual_seed(1000 + step)
    if name in TEXT:
        ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
        labels = torch.randint(0, VOCAB, (n, SEQ), generator=g)
        mask = torch.ones(n, SEQ, dtype=torch.long)
        if pad:
            for i in range(1, n, 2):
                mask[i, SEQ - 1 - (i // 2) % 3:] = 0
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}
    pixels = torch.randn(n, 3, IMAGE, IMAGE, generator=g, dtype=torch.float64).to(dtype)
    return {"pixel_values": pixels, "labels": torch.randint(0, CLASSES, (n,), generator=g)}
