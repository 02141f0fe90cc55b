"""nnscaler.trainer.data_position: the data position carries over in samples, so a run resumed on
another number of data-parallel ranks reads every sample of the epoch once."""
from __future__ import annotations

import pytest
import torch

from nnscaler.trainer.data_position import resumed_step_in_epoch, samples_in_epoch, skip_per_rank
from nnscaler.trainer.errors import TrainerConfigError
from nnscaler.trainer.state import SkippingSampler


def _read(n, dp, per_rank, skip=0, epoch=1, shuffle=True):
    """What `dp` ranks read (each `per_rank` entries after skipping `skip`) of n samples."""
    out = []
    for rank in range(dp):
        sampler = SkippingSampler(torch.utils.data.DistributedSampler(range(n), num_replicas=dp, rank=rank,
                                                                      shuffle=shuffle, seed=3))
        sampler.set_epoch(epoch)
        sampler.skip(skip)
        out += list(sampler)[:per_rank]
    return out


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("dp_before,dp_after", [(2, 1), (2, 4), (4, 2), (1, 2)])
def test_every_sample_once_across_world_sizes(dp_before, dp_after, shuffle):
    n, global_batch, steps = 32, 8, 3
    before = _read(n, dp_before, steps * global_batch // dp_before, shuffle=shuffle)
    done = samples_in_epoch(steps, global_batch)
    after = _read(n, dp_after, n, skip=skip_per_rank(done, dp_after), shuffle=shuffle)
    assert sorted(before + after) == list(range(n))


def test_the_step_in_epoch_follows_the_samples():
    assert resumed_step_in_epoch(24, 3, 8) == 3  # the same global batch
    assert resumed_step_in_epoch(24, 3, 4) == 6 and resumed_step_in_epoch(24, 3, 12) == 2  # a divisor
    assert resumed_step_in_epoch(None, 3, 16) == 3  # a checkpoint without the field: steps as saved


def test_a_global_batch_that_cannot_start_there_is_refused():
    with pytest.raises(TrainerConfigError) as info:
        resumed_step_in_epoch(24, 3, 16, where="ckpt/0000-0003")
    text = str(info.value)
    assert text.startswith("global_batch_size: is 16, but ckpt/0000-0003 stopped 24 samples into its epoch")
    assert "(global batch 8)" in text and "divides 24" in text and "e.g. 6, 8, 12, 24" in text


def test_a_skip_that_does_not_split_over_the_ranks_is_a_bug():
    with pytest.raises(ValueError):
        skip_per_rank(6, 4)
