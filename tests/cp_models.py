"""A small attention + mixture-of-experts model the context-parallel tests share
(tests/policies/test_cp.py, the plan report's cp test in tests/codegen/test_report.py)."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class AttentionMoE(nn.Module):
    """Causal attention, then a mixture-of-experts layer on the flattened tokens (`experts`, top-2)."""

    def __init__(self, experts=4):
        super().__init__()
        self.emb, self.qkv, self.out = nn.Embedding(16, 8), nn.Linear(8, 24), nn.Linear(8, 16)
        self.router = nn.Linear(8, experts, bias=False)
        self.up = nn.Parameter(torch.randn(experts, 16, 8) * 0.1)
        self.down = nn.Parameter(torch.randn(experts, 8, 8) * 0.1)

    def forward(self, ids, labels):
        from nnscaler.ir.ops.moe import routed_experts
        b, s = ids.shape
        q, k, v = self.qkv(self.emb(ids)).view(b, s, 3, 2, 4).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, 8)
        x = y.reshape(-1, 8)
        weights, index = self.router(x).softmax(-1).topk(2, dim=-1)
        y = y + routed_experts(x, index, weights, self.up, self.down).view(b, s, 8)
        return F.cross_entropy(self.out(y).transpose(1, 2), labels)
