"""A compact Llama-style decoder for bench/gpu.py (not part of nnscaler).

RMSNorm (pre-norm), rotary position embeddings (rotate-half form, cos/sin as non-persistent
buffers), causal attention through `F.scaled_dot_product_attention` with optional grouped-query
attention (`n_kv_heads < n_heads`: keys and values repeated per query group), a SwiGLU MLP, and an
output head tied to the token embedding or not (`tie_embeddings`). No biases. `forward(tokens)`
takes a `(batch, seq + 1)` token tensor and returns the mean next-token cross-entropy, so the
model is an end2end module (first argument the sample, first output the loss) usable by
`parallelize(..., use_end2end=True)` and by the Trainer as it is.

`RandomTokens` is a map-style dataset of reproducible random token rows for the Trainer.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class LlamaConfig:
    vocab: int = 32000
    dim: int = 2048
    n_layers: int = 16
    n_heads: int = 16
    n_kv_heads: Optional[int] = None  # None: n_heads; fewer: grouped-query attention
    ffn: int = 5632            # SwiGLU hidden size
    seq: int = 2048            # longest sequence (rotary tables)
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self):
        self.n_kv_heads = self.n_kv_heads or self.n_heads

    def as_dict(self):
        return asdict(self)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # one fused op (float32 inside for bf16 inputs); the x.float() ... .type_as(x) spelling
        # traces right too since the tracer keeps x's own value after a cast that returns x
        # (docs/tracing.md, "Casts that change nothing")
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        if cfg.dim % cfg.n_heads or cfg.n_heads % cfg.n_kv_heads:
            raise ValueError(f"dim {cfg.dim} must divide by n_heads {cfg.n_heads}, and n_heads by n_kv_heads "
                             f"{cfg.n_kv_heads}")
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.n_kv_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if self.n_kv_heads != self.n_heads:
            rep = self.n_heads // self.n_kv_heads
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn, bias=False)  # gate
        self.w3 = nn.Linear(cfg.dim, cfg.ffn, bias=False)  # up
        self.w2 = nn.Linear(cfg.ffn, cfg.dim, bias=False)  # down

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x, cos, sin):
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """The decoder; `Llama(**LlamaConfig fields)` or `Llama(cfg=LlamaConfig(...))`."""

    def __init__(self, cfg: LlamaConfig = None, **fields):
        super().__init__()
        cfg = cfg or LlamaConfig(**fields)
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        head_dim = cfg.dim // cfg.n_heads
        inv = 1.0 / cfg.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        angles = torch.outer(torch.arange(cfg.seq, dtype=torch.float32), inv)
        angles = torch.cat((angles, angles), dim=-1)  # (seq, head_dim), rotate-half layout
        self.register_buffer("rope_cos", angles.cos(), persistent=False)
        self.register_buffer("rope_sin", angles.sin(), persistent=False)
        self._init_weights()

    def _init_weights(self):
        std = 0.02
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, mean=0.0, std=std / (2 * self.cfg.n_layers) ** 0.5
                                if name.endswith(("wo.weight", "w2.weight")) else std)

    def forward(self, tokens):
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        T = inputs.shape[1]
        h = self.tok_embeddings(inputs)
        cos = self.rope_cos[:T].type_as(h)
        sin = self.rope_sin[:T].type_as(h)
        for layer in self.layers:
            h = layer(h, cos, sin)
        logits = self.output(self.norm(h))
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def param_counts(model: Llama):
    """(all parameters, the torchtitan 'num_params' for FLOPs: all but the token embedding;
    with tied embeddings the shared matrix is counted once, as the output head)."""
    total = sum(p.numel() for p in model.parameters())
    flop_params = total if model.cfg.tie_embeddings else total - model.tok_embeddings.weight.numel()
    return total, flop_params


def flops_per_token(model: Llama, seq: int) -> int:
    """Training FLOPs per token: 6 N + 12 L H Q T (PaLM appendix B; torchtitan's
    get_num_flop_per_token), N from `param_counts`, H heads of size Q, sequence T; the causal
    mask's sparsity is not discounted (the common convention)."""
    cfg = model.cfg
    _, n = param_counts(model)
    return 6 * n + 12 * cfg.n_layers * cfg.n_heads * (cfg.dim // cfg.n_heads) * seq


class RandomTokens(torch.utils.data.Dataset):
    """`rows` reproducible rows of `seq + 1` random tokens in [0, vocab) (row i from seed + i)."""

    def __init__(self, rows: int, seq: int, vocab: int, seed: int = 0):
        self.rows, self.seq, self.vocab, self.seed = rows, seq, vocab, seed

    def __len__(self):
        return self.rows

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(self.seed + i)
        return torch.randint(0, self.vocab, (self.seq + 1,), generator=g)
