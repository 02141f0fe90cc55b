"""The Trainer's example (examples/trainer/gpt_char.yaml) with `--nproc 1` on the GPU: `nnscaler
train` (as `python -m nnscaler.cli`, which needs no console script) traces on CUDA
(trace_strategy cuda), trains 8 steps with the loss going down, validates and checkpoints."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gpu_support import HAS_CUDA, gpu

pytestmark = [*gpu, pytest.mark.multiprocess]
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "trainer" / "gpt_char.yaml"


def test_gpt_char_example_with_nproc_1_on_cuda(tmp_path):
    cmd = [sys.executable, "-m", "nnscaler.cli", "train", "-f", str(EXAMPLE), "--nproc", "1",
           "--compute_config.runtime_ngpus", "1", "--global_batch_size", "16",
           "--compute_config.trace_strategy", "cuda" if HAS_CUDA else "cpu",
           "--max_train_steps", "8", "--val_every_n_train_steps", "4", "--checkpoint.every_n_train_steps", "4",
           "--enable_progress_bar", "false"]
    env = dict(os.environ, COLUMNS="200", NO_COLOR="1")
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    losses = [float(m.group(1)) for m in re.finditer(r"^epoch \d+ step \d+/\d+ \| loss ([0-9.]+)", r.stdout, re.M)]
    assert len(losses) == 8 and losses[-1] < losses[0], r.stdout[-2000:]
    assert r.stdout.count("val_loss") == 2
    assert "needs a CUDA device" not in r.stderr or not HAS_CUDA  # traced on the GPU, no CPU fallback
    assert os.readlink(tmp_path / "runs" / "gpt_char" / "checkpoints" / "last") == "0000-0008"
