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


def _val_lines(rank, world, runs):
    """Train each config of `runs` in turn (the same processes); per run, the validation lines rank
    0 printed (``val_loss X (N batches)``)."""
    import contextlib
    import io
    import re

    from loop_helpers import run_trainer
    lines = []
    for data in runs:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):  # the console reporter writes to sys.stdout as it is built
            run_trainer(data)
        lines.append(re.findall(r"val_loss \S+ \(\d+ batches\)", out.getvalue()))
    return lines


@pytest.mark.multiprocess
def test_validation_loss_and_batches_are_the_same_on_one_and_two_processes(tmp_path):
    # 12 validation samples, micro-batch 4: 3 batches; on 2 processes rank 1 runs one padding batch,
    # and with max_val_steps 1 it runs only a padding batch (its aggregation adds nothing).
    # The Trainer runs in this process and in one launch of 2 forked workers (nnscaler train's own
    # launch is tested in test_cli.py)
    from launch import run_workers
    from loop_helpers import config

    def runs(n):
        return [config(tmp_path / f"{n}-{len(over)}", max_train_steps=1, val_every_n_train_steps=1, **{
            "compute_config.runtime_ngpus": n, "dataset.val_args": {"size": 12, "seed": 1}}, **over)
            for over in ({}, {"max_val_steps": 1})]

    one, capped_one = _val_lines(0, 1, runs(1))
    (two, capped), quiet = run_workers(_val_lines, 2, runs(2), timeout=180)
    assert quiet == [[], []]  # rank 0 alone prints
    assert one and one == two and "(3 batches)" in one[0], (one, two)
    assert capped and "(1 batches)" in capped[0] and capped == capped_one, (capped, capped_one)
