"""nnscaler.trainer.data_position: the data position carries over in samples, so a run resumed on
another number of data-parallel ranks, or with a global batch size that divides the samples read,
reads every sample of the epoch once; another global batch size is refused before anything runs."""
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


def _indexed(tmp, log, **over):
    """loop_helpers' run (32 samples, global batch 8), on a dataset whose samples carry their
    index; the hook logs each step's indices under `log`."""
    from loop_helpers import config
    log.mkdir(exist_ok=True)
    return config(tmp, hook={"type": "fault_hooks.Faults", "args": {"index_log": str(log)}}, **{
        "dataset.type": "fault_hooks.IndexDataset", "checkpoint.no_save": False, **over})


def _read_indices(log):
    return sorted(int(line) for f in log.iterdir() for line in f.read_text().split())


def test_a_changed_global_batch_resumes_at_the_same_sample_or_is_refused(tmp_path):
    from loop_helpers import run_trainer
    first, second = tmp_path / "first", tmp_path / "second"
    run_trainer(_indexed(tmp_path, first, max_train_steps=3, **{"checkpoint.every_n_train_steps": 3}))
    assert len(_read_indices(first)) == 24  # 3 steps of 8: 24 samples into epoch 0
    listing = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    with pytest.raises(TrainerConfigError, match=r"^global_batch_size: is 16, but .*0000-0003 stopped 24 samples into "
                                                 r"its epoch \(global batch 8\)"):
        run_trainer(_indexed(tmp_path, second, max_train_steps=4, global_batch_size=16,
                             **{"checkpoint.resume_from": "auto"}))
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == listing and not _read_indices(second)
    # global batch 4: step 6 of the epoch's 8; two steps read the 8 samples left
    run_trainer(_indexed(tmp_path, second, max_train_steps=5, global_batch_size=4,
                         **{"checkpoint.resume_from": "auto"}))
    assert len(_read_indices(second)) == 8 and sorted(_read_indices(first) + _read_indices(second)) == list(range(32))


def _train_dp2(rank, world, data):
    from loop_helpers import run_trainer
    run_trainer(data)


@pytest.mark.multiprocess
def test_dp2_checkpoint_resumed_on_one_process_reads_every_sample_once(tmp_path):
    from launch import run_workers
    from loop_helpers import run_trainer
    first, second = tmp_path / "first", tmp_path / "second"
    run_workers(_train_dp2, 2, _indexed(tmp_path, first, max_train_steps=3, **{
        "compute_config.runtime_ngpus": 2, "micro_batch_size": 2, "checkpoint.every_n_train_steps": 3}), timeout=180)
    assert len(_read_indices(first)) == 24
    with pytest.warns(Warning, match="random states start afresh"):  # the world size changed
        run_trainer(_indexed(tmp_path, second, max_train_steps=4, gen_savedir=str(tmp_path / "gen1"),
                             **{"checkpoint.resume_from": "auto"}))  # micro-batch 4 x 2 accumulated: still 8
    assert sorted(_read_indices(first) + _read_indices(second)) == list(range(32))
