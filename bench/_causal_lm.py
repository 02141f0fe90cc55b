"""`CausalLMLoss` / `HFCausalLMLoss`: a Hugging Face causal LM as the benches train it, returning its loss."""
from __future__ import annotations

import torch
import torch.nn.functional as F


class CausalLMLoss(torch.nn.Module):
    """forward(input_ids, labels) -> the mean cross-entropy of `model`'s logits against `labels`
    (no load-balancing or other auxiliary loss)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, labels):
        logits = self.model(input_ids=input_ids).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


class HFCausalLMLoss(torch.nn.Module):
    """forward(input_ids, labels[, position_ids, attention_mask]) -> the model's own loss (``model(...,
    labels=...).loss``: transformers' ForCausalLMLoss shifts the labels by one, ignores -100, means
    over the rest in float32)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, labels, position_ids=None, attention_mask=None):
        return self.model(input_ids=input_ids, labels=labels, position_ids=position_ids,
                          attention_mask=attention_mask).loss
