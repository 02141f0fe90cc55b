"""Plans on one GPU in one process against the same model in eager PyTorch on the GPU (TF32
off, within 1e-5): `dp`, and `pp` with two stages on the one device (1f1b_interleaved, both
stages' activations and gradients passed on CUDA through the pipeline executor), each under the
seed's default trace strategy. Plans over two processes (dp 2, tp 2, megatron 2) are in
test_gpu_two_processes.py."""
from __future__ import annotations

import torch

from gpu_support import (TOL, assert_close, assert_params_close, device, eager, full_params, gpt_batch, gpu,
                         make_gpt, no_tf32, on, trace_strategy, LR)

pytestmark = gpu
STEPS, N, NMICROS = 3, 8, 4


def test_dp_one_rank_matches_eager(tmp_path):
    from nnscaler import ComputeConfig, build_optimizer, parallelize
    with no_tf32():
        want_losses, want_params = eager(STEPS, N)
        pm = parallelize(make_gpt(), gpt_batch(0, N), "dp", ComputeConfig(1, 1, trace_strategy=trace_strategy()),
                         gen_savedir=tmp_path, instance_name="dp1")
        opt = build_optimizer(pm, torch.optim.SGD, lr=LR)
        losses = []
        for step in range(STEPS):
            loss = pm(**on(gpt_batch(step, N), device()))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    assert_close(losses, want_losses, "dp")
    assert_params_close(full_params(pm), want_params, "dp")


def test_pp_two_stages_on_one_gpu_matches_eager(tmp_path):
    from nnscaler import ComputeConfig, build_optimizer, parallelize
    pas = {"pipeline_nmicros": NMICROS, "pipeline_nstages": 2, "pipeline_scheduler": "1f1b_interleaved",
           "pipeline_pivots": "Block"}
    per = N // NMICROS
    with no_tf32():
        want_losses, want_params = eager(STEPS, N)
        cfg = ComputeConfig(1, 1, trace_strategy=trace_strategy(), use_end2end=True, pas_config=pas)
        pm = parallelize(make_gpt(), gpt_batch(0, per), "pp", cfg, gen_savedir=tmp_path, instance_name="pp")
        assert pm.PIPELINE is not None and pm.device == device()
        opt = build_optimizer(pm, torch.optim.SGD, lr=LR)
        losses = []
        for step in range(STEPS):
            batch = gpt_batch(step, N)
            micros = [{k: v[i * per:(i + 1) * per] for k, v in batch.items()} for i in range(NMICROS)]
            opt.zero_grad()
            outs = pm.train_step(micros)
            opt.scale_grads(1.0 / NMICROS)  # the micro-batch gradients are summed
            opt.step()
            assert len(outs) == NMICROS
            losses.append(sum(float(o.reshape(())) for o in outs) / NMICROS)  # equal micro-batches: the mean
    assert_close(losses, want_losses, "pp", tol=TOL)
    assert_params_close(full_params(pm), want_params, "pp")
