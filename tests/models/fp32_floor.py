"""The rounding floor of single-process training: `python tests/models/fp32_floor.py`.

For each model, one process trains 3 Adam steps on the global batch twice: once whole, once as two
halves with gradient accumulation (mathematically the same step). The per-tensor relative
difference ‖a−b‖/‖b‖ of the parameters is what rounding alone does; a parallel plan reorders sums
the same way, so no plan can be held to less on those parameters (docs/tracing.md, "Real models").
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import model_plans as mp  # noqa: E402


def floor(name, dtype):
    train = name != "resnet"
    _, whole = mp.reference(name, train=train, dtype=dtype)
    _, halves = mp.reference(name, train=train, dtype=dtype, halves=True)
    return sorted((((whole[k] - halves[k]).norm() / halves[k].norm().clamp_min(1e-30)).item(), k) for k in whole)[::-1]


def main():
    for dtype in (torch.float32, torch.float64):
        for name in ("gpt2", "llama", "bert", "resnet", "vit"):
            rel = floor(name, dtype)
            noisy = ", ".join(f"{k.split('.', 1)[1]} {r:.1e}" for r, k in rel if r > 1e-5) or "none"
            rest = max((r for r, _ in rel if r <= 1e-5), default=0.0)
            print(f"{str(dtype):14} {name:7} above 1e-5: {noisy}; every other tensor <= {rest:.1e}")


if __name__ == "__main__":
    main()
