"""Context parallelism's contract between a policy and code generation: attention with its
sequence split over a unit.

A ``scaled_dot_product_attention`` op whose pieces have ``dim == RING_DIM`` holds 1/n of the
query, key and value rows (and of the mask's rows) on each device of the unit; codegen calls the
runtime's ring attention there (``nnscaler.runtime.ring_attention``), which no annotation can
express (each query row needs every key). The `cp` policy makes such pieces.
"""
from __future__ import annotations

__all__ = ["SDPA", "RING_DIM"]

SDPA = "torch.nn.functional.scaled_dot_product_attention"
RING_DIM = "ring"
