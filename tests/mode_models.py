"""Models whose forward depends on the training flag (shared by the IR and runtime mode tests)."""
from __future__ import annotations

import torch
import torch.nn as nn


class DropNorm(nn.Module):
    """Dropout and batch norm (mode-dependent constants and a training-only counter), a
    mode-dependent constant in user code, and a counter updated in both modes."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)
        self.drop = nn.Dropout(0.25)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls += 1
        h = self.drop(self.bn(self.fc(x)))
        return (h * (2.0 if self.training else 0.5)).sum()


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        if self.training:
            h = torch.tanh(h)  # a Python branch: other ops in eval mode
        return h.sum()
