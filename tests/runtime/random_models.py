"""A small GPT with dropout everywhere GPT-2 has it (embeddings, attention probabilities, the
attention and MLP outputs, inside the MLP), for the random-stream tests. Under `megatron` the
attention-probability and MLP dropouts are split over the unit (heads / hidden features) and the
others replicated."""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

CFG = dict(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16, p=0.2)


class Attention(nn.Module):
    def __init__(self, n_embd, n_head, block_size, p):
        super().__init__()
        self.n_head = n_head
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(n_embd, n_embd) for _ in range(3))
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.attn_drop, self.resid_drop = nn.Dropout(p), nn.Dropout(p)
        mask = torch.tril(torch.ones(block_size, block_size, dtype=torch.bool))
        self.register_buffer("mask", mask.view(1, 1, block_size, block_size), persistent=False)

    def forward(self, x):
        B, T, C = x.size()
        q = self.q_proj(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(~self.mask[:, :, :T, :T], float("-inf"))
        y = self.attn_drop(F.softmax(att, dim=-1)) @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_drop(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, n_embd, p):
        super().__init__()
        self.c_fc, self.c_proj = nn.Linear(n_embd, 4 * n_embd), nn.Linear(4 * n_embd, n_embd)
        self.p = p

    def forward(self, x):
        h = F.dropout(F.gelu(self.c_fc(x)), self.p, self.training)
        return F.dropout(self.c_proj(h), self.p, self.training)


class Block(nn.Module):
    def __init__(self, n_embd, n_head, block_size, p):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn = Attention(n_embd, n_head, block_size, p)
        self.mlp = MLP(n_embd, p)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class DropoutGPT(nn.Module):
    def __init__(self, vocab_size, block_size, n_layer, n_head, n_embd, p):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab_size, n_embd), nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(p)
        self.h = nn.ModuleList(Block(n_embd, n_head, block_size, p) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size)

    def forward(self, idx, targets):
        B, T = idx.size()
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def make(dtype=torch.float64, **overrides):
    torch.manual_seed(0)
    return DropoutGPT(**{**CFG, **overrides}).to(dtype)


def batch(step: int, n: int):
    g = torch.Generator().manual_seed(1000 + step)
    seq = torch.randint(0, CFG["vocab_size"], (n, CFG["block_size"] + 1), generator=g)
    return {"idx": seq[:, :-1].contiguous(), "targets": seq[:, 1:].contiguous()}


class Noisy(nn.Module):
    """Gaussian noise (randn_like) and channel dropout (dropout1d) besides plain dropout."""

    def __init__(self, dim: int = 8, hidden: int = 16):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x, y):
        h = F.gelu(self.fc1(x))
        h = h + 0.1 * torch.randn_like(h)
        h = F.dropout1d(h, 0.3, self.training)  # (batch, channels = positions, features)
        out = self.fc2(F.dropout(h, 0.2, self.training))
        return F.mse_loss(out, y)


def make_noisy(dtype=torch.float64):
    torch.manual_seed(0)
    return Noisy().to(dtype)


def noisy_batch(step: int, n: int):
    g = torch.Generator().manual_seed(2000 + step)
    return {"x": torch.randn(n, 4, 8, generator=g, dtype=torch.float64),
            "y": torch.randn(n, 4, 8, generator=g, dtype=torch.float64)}


class HFCausalLM(nn.Module):
    """Hugging Face GPT-2 (tiny config built in code, nothing downloaded) with its dropouts on."""

    def __init__(self, p: float = 0.1):
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel
        cfg = GPT2Config(vocab_size=CFG["vocab_size"], n_positions=CFG["block_size"], n_embd=32, n_layer=2,
                         n_head=4, bos_token_id=0, eos_token_id=0, resid_pdrop=p, embd_pdrop=p, attn_pdrop=p,
                         attn_implementation="eager", use_cache=False)
        self.model = GPT2LMHeadModel(cfg)

    def forward(self, idx, targets):
        logits = self.model(input_ids=idx).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def make_hf_gpt2(dtype=torch.float64):
    import os
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.manual_seed(0)
    return HFCausalLM().to(dtype)
