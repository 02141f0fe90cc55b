"""Gradient accumulation over several `train_step` calls of a pipelined GPT (2 gloo processes):
the tied embedding/head weight lives on both stages and its gradient is a sum over them, which
must count every micro-batch once however the calls are synchronised."""
from __future__ import annotations

import pytest
import torch

from gpt import GPT, GPTConfig, random_batch
from launch import run_workers

CFG = dict(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)


def _micro(i):
    return random_batch(i, 2, GPTConfig(**CFG))


def _reference_grads():
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG))
    sum(model(**_micro(i)) for i in range(4)).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _worker(rank, world, gen_dir):
    from nnscaler import ComputeConfig, parallelize
    torch.manual_seed(0)
    pm = parallelize(GPT(GPTConfig(**CFG)), _micro(0), "pp",
                     ComputeConfig(2, 2, use_end2end=True, trace_strategy="cpu", pas_config={"pipeline_nmicros": 2}),
                     gen_savedir=gen_dir)
    out = {}
    for mode in ("sync_each_call", "sync_last_call"):
        pm.zero_grad()
        if mode == "sync_each_call":
            pm.train_step([_micro(0), _micro(1)])
        else:
            with pm.sync_grad_when(False):
                pm.train_step([_micro(0), _micro(1)])
        pm.train_step([_micro(2), _micro(3)])
        out[mode] = {e.full_name: getattr(pm, local).grad.clone() for local, e in pm.fullmap.items()
                     if getattr(pm, local).grad is not None}
    return out


@pytest.mark.multiprocess
def test_accumulating_over_train_step_calls_counts_each_micro_batch_once(tmp_path):
    results = run_workers(_worker, 2, str(tmp_path / "gen"), timeout=200)
    ref = _reference_grads()
    for mode in ("sync_each_call", "sync_last_call"):
        seen = set()
        for per_rank in results:
            for name, grad in per_rank[mode].items():
                diff = (grad - ref[name]).abs().max().item()
                assert diff <= 1e-5, f"{mode}: {name} differs by {diff}"
                seen.add(name)
        assert "wte.weight" in seen and seen == set(ref) - {"lm_head.weight"}, mode
