"""Small models the bad-input cases share."""
from __future__ import annotations

import torch.nn as nn


class Small(nn.Module):
    """One linear layer whose forward returns a scalar loss."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x).sum()
