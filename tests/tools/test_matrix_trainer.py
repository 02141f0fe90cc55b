"""tools/matrix_trainer.py: the matrix's sample through `nnscaler train` (the command's worker entry
point on gloo processes with torchrun's environment, a YAML config of a tiny Llama on text blocks):
dp2 + ZeRO-3 + recomputation, tp2 and pp2 each end in parity with one process trained by hand
(losses the trainer logged, weights of its last checkpoint merged to a Hugging Face directory).
The configs are valid for the command (fast tier: parsed and validated, no process)."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))

import matrix_trainer  # noqa: E402


@pytest.mark.parametrize("name", list(matrix_trainer.PLANS))
def test_configs_are_valid(tmp_path, name):
    from nnscaler.trainer import TrainerArgs
    world, over = matrix_trainer.PLANS[name]
    text = tmp_path / "text.txt"
    text.write_text("some words to tokenize " * 50)
    args = TrainerArgs.from_dict(matrix_trainer.config(str(tmp_path), str(text), world, over))
    assert args.compute_config.runtime_ngpus == world and args.max_train_steps == matrix_trainer.STEPS
    assert args.pas_policy == over["pas_policy"]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_nnscaler_train_sample_is_parity():
    records = matrix_trainer.run_trainer()
    assert set(records) == set(matrix_trainer.PLANS)
    wrong = {name: r for name, r in records.items() if r["state"] != "parity"}
    assert not wrong, wrong
