"""Two processes on the one GPU, joined by gloo over CUDA tensors (NCCL needs one GPU per rank:
multi-rank NCCL stays unrun on a one-GPU machine).

- gloo's all_reduce, broadcast and list all_gather of CUDA tensors give the right values;
- dp 2, tp 2 and megatron 2 on a GPT against the same model in eager PyTorch on the GPU on the
  global batch (TF32 off, SGD): losses and every parameter within 1e-5;
- the random streams on CUDA: rng_mode="exact" at dp 2 with dropout reproduces one process
  seeded alike (float64, the masks drawn from the CUDA generator): losses and weights within 1e-10.
Pipeline stages over gloo would send CUDA tensors point to point, which gloo does not do; pp on
CUDA is in test_gpu_plans.py (two stages in one process).
"""
from __future__ import annotations

import pytest
import torch

import random_models
import two_process_workers as w
from gpu_support import TOL, assert_close, assert_params_close, device, eager, gpu
from launch import run_workers
from parity import assemble_full

pytestmark = [*gpu, pytest.mark.multiprocess]


def test_gloo_collectives_on_cuda_tensors():
    out = run_workers(w.collectives, 2, timeout=180)
    for r in out:
        assert r["device"] == str(torch.device(device().type, 0) if device().type == "cuda" else device())
        assert torch.equal(r["sum"], torch.full((4,), 3.0))
        assert torch.equal(r["bcast"], torch.full((3,), 1.0))
        assert [p.tolist() for p in r["gathered"]] == [[0.0, 0.0], [1.0, 1.0]]


def test_dp_tp_megatron_on_one_gpu_match_eager(tmp_path):
    want_losses, want_params = eager(w.STEPS, w.N)
    results = run_workers(w.plans, 2, str(tmp_path / "gen"), timeout=400)
    for case in ("dp1", "tp2", "megatron2"):
        assert_close(results[0][case][0], want_losses, case)
        full = assemble_full(((r, res[case][1]) for r, res in enumerate(results)), case)
        for name, value in full.items():
            assert not torch.isnan(value).any(), f"{case}: parts of {name} are held by no rank"
        assert_params_close(full, want_params, case)


def test_exact_random_streams_reproduce_one_process_on_cuda(tmp_path):
    seed = 1234
    dev = device()
    model = random_models.make().to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(seed)  # what pm.manual_seed(seed) stands for (seeds the CUDA generator too)
    want = []
    for step in range(w.STEPS):
        loss = model(**{k: v.to(dev) for k, v in random_models.batch(step, w.N).items()})
        opt.zero_grad()
        loss.backward()
        opt.step()
        want.append(loss.item())
    results = run_workers(w.exact_dropout, 2, str(tmp_path / "gen"), seed, timeout=300)
    assert_close(results[0][0], want, "exact", tol=1e-10)
    params = {k: v.detach().cpu() for k, v in model.named_parameters()}
    for r in results:
        assert_params_close(r[1], params, f"exact rank", tol=1e-10)
    # dropout was really on: the same model without it trains to other losses
    assert abs(results[0][0][0] - random_models.make(p=0.0)(**random_models.batch(0, w.N)).item()) > 1e-6
