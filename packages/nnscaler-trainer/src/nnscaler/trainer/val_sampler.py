"""The validation set, the same whatever the number of data-parallel ranks.

`ValidationSampler` (what the default ``dataset_sampler`` becomes for validation) cuts the
validation dataset, in order, into micro-batches ``B_0 .. B_{K-1}`` of ``micro_batch_size``
samples (the last may be shorter; ``max_val_steps``, when set, caps K), and gives rank r the
batches ``B_r, B_{r+dp}, ...``: every sample once, in the same batches, for any dp. Ranks with
one batch fewer than the others get a padding batch (``B_0`` again) so that every rank runs the
same number of forwards (collectives stay matched); the Trainer leaves the outputs of padding
batches out of the validation loss (`real_batches`). So the validation loss (the mean over
``B_0 .. B_{K-1}``) compares across runs on different numbers of processes, e.g. for ``best``.
"""
from __future__ import annotations

import itertools
import math
from typing import Iterator, List, Optional

import torch

__all__ = ["ValidationSampler"]


class ValidationSampler(torch.utils.data.Sampler):
    """This rank's indices of the validation set (see the module docstring)."""

    def __init__(self, dataset, num_replicas: int, rank: int, batch_size: int, max_batches: Optional[int] = None):
        n = len(dataset)
        count = math.ceil(n / batch_size)
        if max_batches is not None:
            count = min(count, max_batches)
        self.batches: List[List[int]] = [list(range(j * batch_size, min((j + 1) * batch_size, n)))
                                         for j in range(rank, count, num_replicas)]
        self.real_batches = len(self.batches)  # the rest are padding: their outputs are left out
        per_rank = math.ceil(count / num_replicas)
        self.batches += [list(range(min(batch_size, n)))] * (per_rank - self.real_batches)

    def set_epoch(self, epoch: int) -> None:
        """Validation reads the same batches every time."""

    def __iter__(self) -> Iterator[int]:
        return itertools.chain.from_iterable(self.batches)

    def __len__(self) -> int:
        return sum(len(b) for b in self.batches)
