"""Every trace strategy on CUDA: a GPT traced with it, parallelized with `dp` on one rank, trains
on cuda:0 like the same model in eager PyTorch on cuda:0 (losses and weights within 1e-5, TF32
off). The trace itself on CUDA (no CPU fallback, weights left in place, the reuse cache, the CUDA
RNG restored) is in tests/ir/test_trace_device.py."""
from __future__ import annotations

import warnings

import pytest
import torch

from gpu_support import (assert_close, assert_params_close, device, eager, full_params, gpt_batch, gpu, make_gpt,
                         no_tf32, HAS_CUDA, LR)
from nnscaler.ir.config import TRACE_STRATEGIES

pytestmark = gpu
STEPS, N = 3, 8


@pytest.mark.parametrize("strategy", TRACE_STRATEGIES)
def test_every_trace_strategy_trains_like_eager_on_cuda(strategy, tmp_path):
    from nnscaler import ComputeConfig, build_optimizer, parallelize
    with no_tf32():
        want_losses, want_params = eager(STEPS, N)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            pm = parallelize(make_gpt(), gpt_batch(0, N), "dp", ComputeConfig(1, 1, trace_strategy=strategy),
                             gen_savedir=tmp_path, instance_name=strategy)
        if HAS_CUDA:
            assert not [w for w in record if "needs a CUDA device" in str(w.message)], strategy  # no CPU fallback
        assert pm.device == device() and {p.device for p in pm.parameters()} == {device()}
        opt = build_optimizer(pm, torch.optim.SGD, lr=LR)
        losses = []
        for step in range(STEPS):
            loss = pm(**gpt_batch(step, N))  # CPU tensors in: the module moves them to its device
            assert loss.device == device()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    assert_close(losses, want_losses, strategy)
    assert losses[-1] < losses[0]
    assert_params_close(full_params(pm), want_params, strategy)
