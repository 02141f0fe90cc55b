"""The validation set is the same whatever the data-parallel size (ValidationSampler)."""
from __future__ import annotations

import pytest
import torch

from nnscaler.trainer.val_sampler import ValidationSampler


def batches_of(n, dp, mbs, max_batches=None):
    """Per rank: the micro-batches the DataLoader makes from the sampler, and how many are real."""
    out = []
    for rank in range(dp):
        sampler = ValidationSampler(range(n), dp, rank, mbs, max_batches)
        loader = torch.utils.data.DataLoader(list(range(n)), batch_size=mbs, sampler=sampler)
        out.append(([b.tolist() for b in loader], sampler.real_batches))
    return out


@pytest.mark.parametrize("n, mbs, max_batches", [(10, 2, None), (11, 3, None), (7, 4, None), (2, 4, None),
                                                  (20, 2, 5), (9, 2, 100)])
def test_every_world_size_validates_the_same_batches_each_once(n, mbs, max_batches):
    reference = None
    for dp in (1, 2, 3, 4):
        ranks = batches_of(n, dp, mbs, max_batches)
        assert len({len(batches) for batches, _ in ranks}) == 1  # the same number of forwards on every rank
        real = sorted(b for batches, count in ranks for b in batches[:count])
        if reference is None:
            reference = real
            assert real == [list(range(i, min(i + mbs, n))) for i in range(0, n, mbs)][:max_batches]
        assert real == reference, dp  # the same batches, each once, whatever dp
