"""Recompute groups in generated code (codegen/recompute.py) around both branches of a decision:
a value assigned on one branch only (Hugging Face's attention mask, made only for a padded batch)
is passed to, and returned by, the checkpointed function on that branch only, and a decision
taken inside a recomputed module that later ops test is returned by it."""
from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from nnscaler import ComputeConfig, parallelize

from guard_models import build_mask, mask_batch


class Block(nn.Module):
    """Attention under the mask made outside (None or a tensor), and a decision of its own whose
    result (`keep`: None or a tensor) the caller tests after the block."""

    def __init__(self, dim=8, heads=2):
        super().__init__()
        self.qkv, self.proj, self.heads = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim), heads

    def forward(self, h, mask, attention_mask):
        b, s, _ = h.shape
        q, k, v = self.qkv(h).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        h = h + self.proj(a.transpose(1, 2).reshape(b, s, -1))
        keep = None
        if not (attention_mask == 1).all():  # decided inside the recomputed block
            keep = attention_mask.to(h.dtype)[..., None]
        return h, keep


class MaskedStack(nn.Module):
    def __init__(self, dim=8, vocab=16):
        super().__init__()
        self.emb, self.out = nn.Embedding(vocab, dim), nn.Linear(dim, vocab)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(2))

    def forward(self, input_ids, attention_mask):
        h = self.emb(input_ids)
        mask = build_mask(attention_mask, input_ids.shape[1])  # assigned on the padded branch only
        for block in self.blocks:
            h, keep = block(h, mask, attention_mask)
            if keep is not None:  # tests the block's own decision
                h = h * keep
        return self.out(h).logsumexp(-1).mean()


def _model():
    torch.manual_seed(0)
    return MaskedStack().double()


def _grads(model, batch):
    loss = model(**batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("traced_padded", [False, True])
def test_recomputed_blocks_take_either_branch(tmp_path, traced_padded):
    cfg = ComputeConfig(1, 1, trace_strategy="cpu", pas_config={"recompute_modules": "Block"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = parallelize(_model(), mask_batch(0, 2, traced_padded), "dp", cfg, gen_savedir=tmp_path)
    code = open(__import__("sys").modules[type(pm).__module__].__file__).read()
    calls = [line.strip() for line in code.splitlines() if "torch.utils.checkpoint.checkpoint(" in line]
    assert len(calls) == 2, calls
    # the mask exists on one branch only: both calls pass it on that branch only
    assert all(re.search(r"\((\w+) if not _branch_\d+ else None\)", c) for c in calls), calls
    # each block's own decision comes back from its function (the code after the block tests it)
    assert all(re.match(r"\(.*_branch_\d+,?\) = ", c) for c in calls), calls
    compile(code, "gencode0.py", "exec")
    pm.train()
    names = dict(zip((n for n, _ in pm.named_parameters()), (pm.fullmap[n].full_name for n, _ in pm.named_parameters())))
    for step, padded in enumerate([False, True, True, False]):
        batch = mask_batch(step, 2, padded)
        want_loss, want = _grads(_model(), batch)
        pm.zero_grad()
        loss, got = _grads(pm, batch)
        assert abs(loss.item() - want_loss.item()) <= 1e-12, (step, padded)
        for local, grad in got.items():
            assert torch.allclose(grad, want[names[local]], rtol=0, atol=1e-12), (step, padded, names[local])
