"""`nnscaler.trainer.moe`'s load numbers: the global batch's tokens per expert of each layer (in the
loggers as ``tokens_per_expert/<layer>/<expert>``) and, with a capacity factor, the (token, slot) pairs
dropped (console line and loggers: ``dropped_tokens``, ``dropped_fraction``).

- unit tier: `MoEMeter` on a recorded load, the console line, the scalars;
- one launch: the hf_moe example (tiny Mixtral, ``ep`` 2) with ``model.args.capacity_factor`` 0.5 for
  2 steps: every step's console line says the pairs dropped, and TensorBoard holds, per layer, the
  tokens per expert adding up to the step's tokens x top-k, and the same dropped count.
"""
from __future__ import annotations

import glob
import os
import re

import pytest
import torch

from nnscaler.trainer import MoEMetrics, TrainStepMetrics
from nnscaler.trainer.loggers.console import format_train_line
from nnscaler.trainer.loggers.event_file import read_scalars
from nnscaler.trainer.moe import MoEMeter
from cli_workers import train_in_workers
from test_cli import HERE

ROOT = os.path.dirname(os.path.dirname(HERE))
EXAMPLE = os.path.join(ROOT, "examples", "trainer", "hf_moe.yaml")


def test_meter_sums_every_ranks_own_tokens_and_dropped_pairs():
    from nnscaler.runtime.moe import expert_load
    meter = MoEMeter(aux_loss_output=None)
    meter.begin()
    expert_load().add(torch.tensor([4.0, 0.0, 2.0, 2.0]), "l0", own=torch.tensor([3.0, 0.0, 1.0, 0.0]), dropped=1)
    expert_load().add(torch.tensor([2.0, 2.0, 2.0, 2.0]), "l1", own=torch.tensor([1.0, 1.0, 1.0, 1.0]), dropped=0)
    expert_load().add(torch.tensor([4.0, 0.0, 2.0, 2.0]), "l0", own=torch.tensor([1.0, 0.0, 0.0, 2.0]), dropped=2)
    m = meter.end([])
    assert m.tokens_per_expert == {"l0": [4.0, 0.0, 1.0, 2.0], "l1": [1.0, 1.0, 1.0, 1.0]}
    assert m.dropped_tokens == 3 and m.dropped_fraction == pytest.approx(3 / 11)
    assert expert_load().own == {} and expert_load().dropped == {}
    expert_load().add(torch.tensor([1.0, 1.0]), "l0", own=torch.tensor([1.0, 1.0]))  # dropless: no dropped count
    assert meter.end([]).dropped_tokens is None


def test_console_line_says_dropped_tokens_and_loggers_get_tokens_per_expert():
    moe = MoEMetrics(aux_loss=2.0, expert_imbalance=1.5, tokens_per_expert={"model.layers.0.mlp.experts": [3.0, 1.0]},
                     dropped_tokens=12, dropped_fraction=0.012)
    m = TrainStepMetrics(epoch=0, step=3, train_loss=6.2, lr=1e-3, moe=moe)
    assert "| expert_imbalance 1.50 | dropped_tokens 12 (1.2%) | lr" in format_train_line(m, 20)
    scalars = m.scalars()
    assert scalars["tokens_per_expert/model.layers.0.mlp.experts/0"] == 3.0
    assert scalars["tokens_per_expert/model.layers.0.mlp.experts/1"] == 1.0
    assert scalars["dropped_tokens"] == 12 and scalars["dropped_fraction"] == 0.012
    dropless = TrainStepMetrics(epoch=0, step=3, train_loss=6.2, lr=1e-3, moe=MoEMetrics(expert_imbalance=1.5))
    assert "dropped_tokens" not in format_train_line(dropless, 20) and "dropped_tokens" not in dropless.scalars()


LINE = re.compile(r"^epoch \d+ step (\d+)/\d+ .*\| dropped_tokens (\d+) \(([0-9.]+)%\) \|", re.M)


@pytest.mark.multiprocess
def test_the_example_with_a_capacity_logs_dropped_tokens_and_tokens_per_expert(tmp_path):
    run = tmp_path / "run"
    data = [f"--dataset.{split}_args.{key}={value}" for split in ("train", "val")
            for key, value in (("files", "docs/trainer.md"), ("cache_dir", tmp_path / "datasets"))]
    argv = ["--vars.run_dir", str(run), "--max_train_steps", "2", "--val_every_n_train_steps", "10",
            "--checkpoint.every_n_train_steps", "2", "--enable_progress_bar", "false",
            "--model.args.capacity_factor", "0.5", *data]
    r = train_in_workers("-f", EXAMPLE, "--nproc", "2", *argv, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = LINE.findall(r.stdout)
    assert [int(s) for s, _, _ in lines] == [1, 2], r.stdout
    [events] = glob.glob(str(run / "tensorboard" / "train" / "events.*"))
    logged = {}
    for step, tag, value in read_scalars(events):
        logged.setdefault(tag, {})[step] = value
    layers = {tag.split("/")[1] for tag in logged if tag.startswith("tokens_per_expert/")}
    assert len(layers) == 2, sorted(logged)  # the example's 2 MoE layers, 4 experts each
    pairs = 8 * 64 * 2  # micro-batch 8 x block 64 tokens, top-2
    for step, dropped, percent in lines:
        step = int(step)
        for layer in layers:
            counts = [logged[f"tokens_per_expert/{layer}/{e}"][step] for e in range(4)]
            assert sum(counts) == pairs, (layer, counts)
        # capacity 0.5 x 1024 / 4 = 128 pairs per expert and layer: at least half the pairs dropped
        assert logged["dropped_tokens"][step] == int(dropped) >= pairs
        assert logged["dropped_fraction"][step] == pytest.approx(int(dropped) / (2 * pairs))
        assert float(percent) == pytest.approx(100 * int(dropped) / (2 * pairs), abs=0.05)
