"""The seed's Lite example (examples/lightning/lite_boring.py) on 2 gloo processes: with nnscaler's
Fabric strategy, dp and tp, it trains as with Fabric's DDPStrategy (within 1e-5)."""
from __future__ import annotations

import pytest
import torch

from launch import run_workers
import lite_workers

TOL = 1e-5
EPOCHS = 2


def _per_step(gathered):
    """[world, steps] -> the loss of each step over every rank (the ranks of a tp unit agree)."""
    return torch.stack([g.float().mean(0) for g in gathered])


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    """Rank 0's record of the example under Fabric's DDPStrategy: every case's reference, run once."""
    return run_workers(lite_workers.run, 2, str(tmp_path_factory.mktemp("ddp")), "ddp", 1, EPOCHS, timeout=240)[0]


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind,batch_size", [("dp", 1), ("tp", 2)])
def test_lite_example_matches_fabric_ddp(tmp_path, kind, batch_size, ddp):
    ours = run_workers(lite_workers.run, 2, str(tmp_path), kind, batch_size, EPOCHS, timeout=240)
    r = ours[0]
    assert len(r["train"]) == len(ddp["train"]) == EPOCHS
    assert ddp["train"][0].shape == (2, 32)  # 64 samples, 2 ranks, batch 1
    if kind == "tp":
        assert r["train"][0].shape == (2, 32)  # one unit, batches of 2: both ranks hold the same losses
        torch.testing.assert_close(r["train"][0][0], r["train"][0][1], atol=0, rtol=0)
    # the epoch means the example prints, and every step's loss
    for a, b in ((r["train"], ddp["train"]), (r["val"], ddp["val"])):
        torch.testing.assert_close(torch.stack([g.mean() for g in a]), torch.stack([g.mean() for g in b]),
                                   atol=TOL, rtol=0)
    torch.testing.assert_close(_per_step(r["train"]), _per_step(ddp["train"]), atol=TOL, rtol=0)
    assert _per_step(ddp["train"])[-1].mean() < _per_step(ddp["train"])[0].mean()  # it trains
    assert set(r["weights"]) == set(ddp["weights"]) == {"layer.weight", "layer.bias"}
    for key, ref in ddp["weights"].items():
        torch.testing.assert_close(r["weights"][key], ref, atol=TOL, rtol=0)
    assert ours[1]["weights"].keys() == r["weights"].keys()
    assert [o["rank_at_start"] for o in ours] == [0, 1]  # rank_zero_only as an import in the worker sets it
