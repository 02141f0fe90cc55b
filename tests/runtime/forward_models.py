"""Models whose forward does what a trace could get silently wrong: calling the user's own
``torch.autograd.Function`` s (called by name by the generated code) and updating parameters in
place under no_grad. Importable by spawned workers."""
from __future__ import annotations

import torch
import torch.nn as nn


class RoundSTE(torch.autograd.Function):
    """Straight-through estimator: forward rounds, backward passes the gradient on unchanged."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class ScaleGrad(torch.autograd.Function):
    """Identity forward, gradient scaled by `scale` (the setup_context style)."""

    @staticmethod
    def forward(x, scale):
        return x.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.scale = inputs[1]

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


class OuterSTE(torch.autograd.Function):
    """A Function that calls another one inside its forward: one node, the inner one unseen."""

    @staticmethod
    def forward(ctx, x):
        return RoundSTE.apply(x) * 1.0

    @staticmethod
    def backward(ctx, grad):
        return grad


class QuantMLP(nn.Module):
    """An MLP whose hidden activations are rounded by a straight-through estimator."""

    def __init__(self, width=16):
        super().__init__()
        self.fc1 = nn.Linear(8, width)
        self.fc2 = nn.Linear(width, 8)

    def forward(self, x, y):
        h = RoundSTE.apply(self.fc1(x) * 4) / 4
        h = ScaleGrad.apply(torch.relu(h), 0.5)
        return ((self.fc2(h) - y) ** 2).mean()


def quant_batch(step, n, dtype=torch.float64):
    g = torch.Generator().manual_seed(100 + step)
    return {"x": torch.randn(n, 8, generator=g, dtype=dtype), "y": torch.randn(n, 8, generator=g, dtype=dtype)}


def make_quant_mlp():
    torch.manual_seed(0)
    return QuantMLP().double()


class MaxNormMLP(nn.Module):
    """A forward that updates parameters in place under no_grad: a max-norm constraint on fc1's rows
    and a decay of fc2's weight (both must run in the generated program, not once while tracing)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 8)

    def forward(self, x, y):
        with torch.no_grad():
            w = self.fc1.weight
            w.div_(w.norm(dim=1, keepdim=True).clamp(min=0.5) * 2)
            self.fc2.weight.mul_(0.9)
        h = torch.relu(self.fc1(x))
        return ((self.fc2(h) - y) ** 2).mean()


def make_max_norm_mlp():
    torch.manual_seed(0)
    return MaxNormMLP().double()


MODELS = {"quant": make_quant_mlp, "max_norm": make_max_norm_mlp}
