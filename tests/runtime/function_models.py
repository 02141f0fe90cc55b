"""Models calling the user's own ``torch.autograd.Function`` s (importable by spawned workers and
by the generated code, which calls the Functions by name)."""
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
