"""The Lightning strategy on the GPU (`accelerator="gpu", devices=1`): NnScalerStrategy with the
`dp` plan trains the classifier of tests/lightning like Lightning's DDPStrategy on the one GPU (the
reference tests/lightning uses) (SGD with momentum, TF32 off: per-step losses and weights within 1e-5), its module on CUDA;
with `cpu_offload=True` the same numbers, the optimizer's state on the CPU and the module on the
GPU, and the offload copies (values and gradients) in pinned memory."""
from __future__ import annotations

import pytest
import torch

import lightning_workers
from gpu_support import HAS_CUDA, TOL, cuda_only, gpu
from launch import run_workers

pytestmark = [*gpu, pytest.mark.multiprocess]


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """One worker process runs all three fits (spawning costs seconds)."""
    return run_workers(lightning_workers.fit, 1, str(tmp_path_factory.mktemp("lightning_gpu")), timeout=400)[0]


def _same(got, want, what):
    torch.testing.assert_close(got["losses"], want["losses"], atol=TOL, rtol=0, msg=lambda m: f"{what} losses: {m}")
    assert set(got["weights"]) == set(want["weights"]), what
    for k, v in want["weights"].items():
        torch.testing.assert_close(got["weights"][k], v, atol=TOL, rtol=0, msg=lambda m: f"{what} {k}: {m}")


def test_strategy_on_one_gpu_matches_lightning(fitted):
    want = fitted["lightning"]
    assert len(want["losses"]) == 16 and want["losses"][-1] < want["losses"][0]
    got = fitted["nnscaler"]
    assert got["param_devices"] == {"cuda" if HAS_CUDA else "cpu"} and not got["offloaded"]
    _same(got, want, "nnscaler")


def test_cpu_offload_on_one_gpu_matches_lightning(fitted):
    got = fitted["offload"]
    assert got["offloaded"] and got["n_copies"] > 0
    assert got["param_devices"] == {"cuda" if HAS_CUDA else "cpu"}
    assert got["n_states"] > 0 and got["state_devices"] == {"cpu"}
    _same(got, fitted["lightning"], "cpu_offload")


@cuda_only
def test_cpu_offload_copies_are_pinned(fitted):
    pinned = fitted["offload"]["copies_pinned"]
    assert pinned and all(pinned)
