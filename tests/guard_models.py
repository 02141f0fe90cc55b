"""Models whose forward decides in Python on tensor values (guards and both-branch decisions; shared by
the IR, codegen and runtime tests, importable by spawned workers)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MaskBranch(nn.Module):
    """`if (mask == 1).all():` picks one of two computations (both can be traced)."""

    def __init__(self, dim=8):
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x, mask):
        h = self.fc(x)
        if (mask == 1).all():  # guarded line
            h = h * 2
        else:
            h = h * mask
        return h.sum()


class ItemScale(nn.Module):
    """`.item()` of a value computed from the input, used as a Python number."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, n):
        k = n.max().item()  # item line
        return (self.fc(x) * k).sum()


class NumpyScale(nn.Module):
    """A value taken through NumPy (`x.numpy()`, `np.asarray(t)`) and used as a Python number."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, n):
        import numpy as np
        k = n.numpy().max()  # numpy line
        j = np.asarray(n).min()  # asarray line
        return (self.fc(x) * float(k) + float(j)).sum()


def fast_all(t):
    """Hugging Face's masking_utils.fast_all: `tensor.sum() == tensor.numel()`."""
    return t.sum() == t.numel()


def build_mask(attention_mask, seq, right_padded=False):
    """HF's sdpa_mask pattern: None (SDPA is_causal) when nothing is padded, else a boolean mask.
    With `right_padded`, the padded branch alone asks the data again (as HF's "is the padding only
    in future positions?"): a guard inside one branch."""
    if attention_mask is None or fast_all(attention_mask):  # the decision on the data
        return None
    if right_padded:
        assert fast_all(attention_mask[:, :1]), "the first position is never padded"  # guard in a branch
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    return causal[None, None] & attention_mask.bool()[:, None, None, :]


class HFMaskAttention(nn.Module):
    """A toy of the HF attention mask pattern: both branches produce the mask or None and feed SDPA."""

    def __init__(self, dim=8, heads=2, vocab=16, right_padded=False):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, vocab)
        self.heads, self.right_padded = heads, right_padded

    def forward(self, input_ids, attention_mask):
        b, s = input_ids.shape
        h = self.emb(input_ids)
        q, k, v = self.qkv(h).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        mask = build_mask(attention_mask, s, self.right_padded)
        if mask is None:
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=None, is_causal=True)
        else:
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=False)
        logits = self.out(a.transpose(1, 2).reshape(b, s, -1))
        keep = attention_mask.to(logits.dtype)
        return (logits.logsumexp(-1) * keep).sum() / keep.sum()


def mask_batch(step, n, padded, seq=6, vocab=16, dtype=torch.float64):
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, vocab, (n, seq), generator=g)
    mask = torch.ones(n, seq, dtype=torch.int64)
    if padded:
        mask[::2, seq - 2:] = 0  # every other sample padded at the end
    return {"input_ids": ids, "attention_mask": mask}


class AssertMask(nn.Module):
    """The other branch cannot run (it raises), so the decision stays a guard."""

    def __init__(self, dim=8):
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x, mask):
        h = self.fc(x)
        if (mask == 1).all():  # assert line
            h = h * 2
        else:
            raise ValueError("this model takes unmasked batches only")
        return h.sum()


class PipeGuard(nn.Module):
    """Four layers (a pipeline splits them) and a check of the data in the second half whose other
    branch cannot run (so it stays a guard)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x, mask):
        h = x
        for i, layer in enumerate(self.layers):
            h = torch.tanh(layer(h))
            if i == 2:
                assert (mask == 1).all(), "this model takes unmasked batches only"  # pipelined guard line
        return h.sum()


class MaskPrep(nn.Module):
    """The decision on the data, and a mask made on one branch only (HF's create_causal_mask; its own
    module, so a recompute group can hold it)."""

    def forward(self, mask):
        if (mask == 1).all():  # pipelined decision line
            return None
        return mask * 0.5 + 0.5


class PipeMask(nn.Module):
    """Four layers (a pipeline splits them), each reading the mask that only the padded branch of a
    decision taken before the first one makes: the later stages need the decision and the mask."""

    def __init__(self):
        super().__init__()
        self.prep = MaskPrep()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x, mask):
        m = self.prep(mask)
        h = x
        for layer in self.layers:
            h = torch.tanh(layer(h))
            if m is not None:
                h = h * m
        return h.sum()


class LoopDecisions(nn.Module):
    """Several decisions in a loop, each on a value the previous ones changed."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x):
        x = self.fc(x)
        for i in range(3):
            if x[0, i] > 0:
                x = x + 1
            else:
                x = x - 1
        return x.sum()
