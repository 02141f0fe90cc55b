"""A small character-level GPT for the Trainer example: `gpt_char.yaml` names these classes.

`CharGPT` is examples/gpt.py's GPT as an end2end module (forward takes the batch, returns the
loss); `CharCorpus` cuts a UTF-8 text file shipped with the repository (docs/architecture.md by
default) into byte sequences, the last 10% held out for validation.
"""
from __future__ import annotations

import os
import sys

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))  # examples/: the GPT of examples/gpt.py
from gpt import GPT  # noqa: E402

DEFAULT_TEXT = os.path.join(os.path.dirname(os.path.dirname(_HERE)), "docs", "architecture.md")


class CharGPT(GPT):
    """GPT over bytes (vocab 256): ``forward({'idx': [B, T], 'targets': [B, T]}) -> loss``."""

    def __init__(self, n_layer: int = 2, n_head: int = 4, n_embd: int = 64, block_size: int = 32):
        super().__init__(vocab_size=256, n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=block_size)

    def forward(self, batch):
        return super().forward(batch["idx"], batch["targets"])


class CharCorpus(torch.utils.data.Dataset):
    """Non-overlapping windows of `block_size + 1` bytes of `path` (split 'train' or 'val')."""

    def __init__(self, split: str = "train", path: str = DEFAULT_TEXT, block_size: int = 32, val_fraction: float = 0.1):
        with open(path, "rb") as f:
            data = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8).long()
        cut = int(len(data) * (1 - val_fraction))
        self.data = data[:cut] if split == "train" else data[cut:]
        self.block_size = block_size

    def __len__(self):
        return (len(self.data) - 1) // self.block_size

    def __getitem__(self, i):
        chunk = self.data[i * self.block_size:(i + 1) * self.block_size + 1]
        return {"idx": chunk[:-1], "targets": chunk[1:]}
