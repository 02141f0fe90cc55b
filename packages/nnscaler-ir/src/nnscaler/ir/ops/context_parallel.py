"""Context parallelism's contract between a policy and code generation: ops with the sequence
split over a unit that no annotation can express.

- A ``scaled_dot_product_attention`` op whose pieces have ``dim == RING_DIM`` holds 1/n of the
  query, key and value rows (and of the mask's rows) on each device of the unit; codegen calls the
  runtime's ring attention there (``nnscaler.runtime.ring_attention``): each query row needs every
  key.
- A ``cross_entropy`` op with ``reduction='mean'`` whose pieces have ``dim == SEQUENCE_LOSS_DIM``
  holds 1/n of the tokens (input and target) and gives the whole mean on every device (placement
  R); codegen calls ``nnscaler.runtime.sequence_loss.cross_entropy``, which sums its own tokens'
  losses and all-reduces the sum and the count (a mean of partial means is not the mean, so the
  annotation cannot split it).

The `cp` policy makes such pieces.
"""
from __future__ import annotations

__all__ = ["SDPA", "RING_DIM", "CROSS_ENTROPY", "SEQUENCE_LOSS_DIM"]

SDPA = "torch.nn.functional.scaled_dot_product_attention"
RING_DIM = "ring"
CROSS_ENTROPY = "torch.nn.functional.cross_entropy"
SEQUENCE_LOSS_DIM = "sequence_loss"
