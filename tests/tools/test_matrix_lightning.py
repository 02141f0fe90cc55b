"""tools/matrix_lightning.py: the matrix's sample through the Lightning strategy (a LightningModule
holding the matrix's tiny Llama, `lightning.pytorch.Trainer` + `NnScalerStrategy` on 2 gloo
processes): dp2 + ZeRO-3 + recomputation and tp2 end in parity with one process (float32, 1e-5),
in one launch."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))

import matrix_lightning  # noqa: E402


@pytest.mark.multiprocess
@pytest.mark.slow
def test_lightning_sample_is_parity():
    records = matrix_lightning.run_lightning()
    assert set(records) == set(matrix_lightning.PLANS)
    wrong = {name: r for name, r in records.items() if r["state"] != "parity"}
    assert not wrong, wrong
