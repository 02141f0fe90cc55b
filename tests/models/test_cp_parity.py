"""Long context: transformers' Llama and Qwen2 (tiny configs, sdpa attention) train under context
parallelism exactly as in one process, in float64: every loss and every parameter after 3 Adam
steps within 1e-10 of single-process training on the global batch.

- ``cp`` 2 and ``cp`` 4: every op split along the sequence, attention as ring attention (causal rows
  balanced); a padded batch (attention mask with padding keys) under cp 2.
- ``cp`` 2 x dp 2 on 4 processes: each unit takes half of the batch, the loss is the mean over all
  tokens (the reference: gradient accumulation over the two halves, each loss / 2).
"""
from __future__ import annotations

import glob

import pytest

import model_plans as mp
from launch import run_workers
from test_hf_parity import _check

CP2 = [dict(mp.plan("cp2", "cp", 2), model="llama64"), dict(mp.plan("q-cp2", "cp", 2), model="qwen2"),
       dict(mp.plan("cp2-pad", "cp", 2, pad=True), model="llama64")]
WORLD4 = [dict(mp.plan("cp4", "cp", 4), model="llama64"), dict(mp.plan("cp2-dp2", "cp", 2), model="qwen2"),
          dict(mp.plan("cp2-dp2-zero3", "cp", 2, use_zero=3), model="llama64")]


def _activations_split(results, label):
    """Rank 0's local parameters are whole: cp splits activations, not weights."""
    return all(tuple(v.shape) == tuple(shape) for _, shape, _, v in results[0][label][1])


@pytest.mark.multiprocess
@pytest.mark.slow
def test_cp2(tmp_path):
    results = run_workers(mp.run_plans, 2, CP2, str(tmp_path / "gen"), timeout=300)
    _check(results, CP2)
    assert _activations_split(results, "cp2")
    for label in ("cp2", "q-cp2", "cp2-pad"):  # attention runs as ring attention on both ranks
        code = [open(p).read() for p in glob.glob(str(tmp_path / "gen" / label / "**" / "gencode*.py"), recursive=True)]
        assert len(code) == 2 and all(c.count("nr.ring_attention.attention(") >= 2 for c in code), label


@pytest.mark.multiprocess
@pytest.mark.slow
def test_cp4_and_cp2_dp2(tmp_path):
    results = run_workers(mp.run_plans, 4, WORLD4, str(tmp_path / "gen"), timeout=400)
    _check(results, WORLD4, halves_for=("cp2-dp2", "cp2-dp2-zero3"))
