"""Models whose forward depends on a mode: the training flag, the grad mode, autocast (shared by the
IR, codegen and runtime tests)."""
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


class TeacherStudent(nn.Module):
    """A teacher under torch.no_grad() (three ops) and a student under bf16 autocast."""

    def __init__(self):
        super().__init__()
        self.teacher, self.student = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        with torch.no_grad():
            t = self.teacher(x)
            t = torch.relu(t) * 2
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = self.student(x)
        return ((h.float() - t) ** 2).mean()
