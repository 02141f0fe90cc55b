"""Activation recomputation on CUDA: with every Block recomputed (`recompute_modules`), one
forward + backward of a GPT peaks lower in `torch.cuda.max_memory_allocated` than without, with
the same gradients (recomputation reruns the same kernels)."""
from __future__ import annotations

import torch

from gpu_support import cuda_only, gpt_batch, make_gpt, no_tf32

import pytest

pytestmark = [pytest.mark.gpu, cuda_only]
BIG = dict(vocab_size=256, block_size=256, n_layer=4, n_head=4, n_embd=256)  # activations >> weights
N = 16


def _peak(pm, batch):
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss = pm(**batch)
    loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    grads = {n: p.grad.detach().cpu().clone() for n, p in pm.named_parameters()}
    pm.zero_grad(set_to_none=True)
    return loss.item(), grads, peak


def test_recompute_lowers_the_peak_memory_on_cuda(tmp_path):
    from nnscaler import ComputeConfig, parallelize
    batch = gpt_batch(0, N, **BIG)
    with no_tf32():
        plain = parallelize(make_gpt(**BIG), batch, "dp", ComputeConfig(1, 1), gen_savedir=tmp_path,
                            instance_name="plain")
        cfg = ComputeConfig(1, 1, pas_config={"recompute_modules": "Block"})
        recomputed = parallelize(make_gpt(**BIG), batch, "dp", cfg, gen_savedir=tmp_path, instance_name="recompute")
        batch = {k: v.cuda() for k, v in batch.items()}
        loss_a, grads_a, peak_a = _peak(plain, batch)
        del plain
        loss_b, grads_b, peak_b = _peak(recomputed, batch)
    assert abs(loss_a - loss_b) <= 1e-6 * abs(loss_a)
    for name, g in grads_a.items():
        assert torch.allclose(grads_b[name], g, rtol=1e-4, atol=1e-6), name
    assert peak_b < 0.7 * peak_a, f"peak with recomputation {peak_b} B, without {peak_a} B"
