"""Activation recomputation: same gradients, fewer saved activations, under dp and tp."""
from __future__ import annotations

import pytest
import torch

from gpt import GPT, GPTConfig, random_batch
from launch import run_workers
from nnscaler import ComputeConfig, parallelize
from nnscaler.policies import PlanError

CFG = dict(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)


def _model():
    torch.manual_seed(0)
    return GPT(GPTConfig(**CFG))


def _grads_and_saved(pm, batch):
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        loss = pm(**batch)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in pm.named_parameters()}
    return loss.detach(), grads, sum(saved)


def test_recompute_modules_gives_identical_gradients_and_saves_less(tmp_path):
    batch = random_batch(0, 4, GPTConfig(**CFG))
    plain = parallelize(_model(), batch, "dp", ComputeConfig(1, 1, trace_strategy="cpu"), gen_savedir=tmp_path,
                        instance_name="plain")
    cfg = ComputeConfig(1, 1, trace_strategy="cpu", pas_config={"recompute_modules": "Block"})
    recomputed = parallelize(_model(), batch, "dp", cfg, gen_savedir=tmp_path, instance_name="recompute")
    code = open(__import__("sys").modules[type(recomputed).__module__].__file__).read()
    assert code.count("torch.utils.checkpoint.checkpoint(") == 2  # one per Block (h.0, h.1)
    loss_a, grads_a, saved_a = _grads_and_saved(plain, batch)
    loss_b, grads_b, saved_b = _grads_and_saved(recomputed, batch)
    assert torch.equal(loss_a, loss_b)
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), name
    assert saved_b < saved_a / 2, (saved_a, saved_b)


def test_recompute_by_path_and_unknown_names(tmp_path):
    from nnscaler.ir import trace
    from nnscaler.policies import recompute_modules
    graph = trace(_model(), random_batch(0, 2, GPTConfig(**CFG)), trace_strategy="cpu")
    assert recompute_modules(graph, "h.*.mlp, gpt.Block") == ["h.0", "h.1"]  # outermost wins
    assert {n.recompute for n in graph.nodes if n.module_path.startswith("h.1")} == {"h.1"}
    with pytest.raises(PlanError, match="'Blok' matches no module of gpt.GPT; module types there: .*Block"):
        recompute_modules(graph, "Blok")


def tp_recompute(rank, world, gen_dir):
    batch = random_batch(0, 8, GPTConfig(**CFG))
    out = {}
    for name, pas in (("plain", {}), ("recompute", {"recompute_modules": "CausalSelfAttention,MLP"})):
        cfg = ComputeConfig(2, 2, trace_strategy="cpu", pas_config=pas)
        pm = parallelize(_model(), batch, "megatron", cfg, gen_savedir=gen_dir, instance_name=name)
        loss = pm(**batch)
        loss.backward()
        out[name] = (loss.item(), {k: p.grad.clone() for k, p in pm.named_parameters()})
    return out


@pytest.mark.multiprocess
def test_recompute_with_tensor_parallel_collectives(tmp_path):
    """Recomputed segments rerun their collectives in backward: gradients are unchanged."""
    for rank_result in run_workers(tp_recompute, 2, str(tmp_path), timeout=180):
        (loss_a, grads_a), (loss_b, grads_b) = rank_result["plain"], rank_result["recompute"]
        assert loss_a == loss_b
        for name, grad in grads_a.items():
            assert torch.allclose(grad, grads_b[name], atol=1e-7, rtol=0), name


def test_recompute_under_use_zero_3_trains_like_one_process(tmp_path):
    """Recomputed blocks read their parameters again inside backward: use_zero=3 gathers the unit for
    the recomputation, and training matches the plain module exactly."""
    from nnscaler import build_optimizer
    results = {}
    for use_zero, pas in ((False, {}), (3, {"recompute_modules": "Block"})):
        pm = parallelize(_model(), random_batch(0, 4, GPTConfig(**CFG)), "dp",
                         ComputeConfig(1, 1, trace_strategy="cpu", use_zero=use_zero, pas_config=pas),
                         gen_savedir=tmp_path, instance_name=f"rc_zero{int(use_zero)}")
        opt = build_optimizer(pm, torch.optim.Adam, lr=1e-2)
        losses = []
        for step in range(3):
            opt.zero_grad()
            loss = pm(**random_batch(step, 4, GPTConfig(**CFG)))
            loss.backward()
            opt.step()
            losses.append(loss.item())
        with pm.unsharded():
            results[use_zero] = losses, {n: p.detach().clone() for n, p in pm.named_parameters()}
    assert results[3][0] == results[False][0]
    for name, value in results[False][1].items():
        assert torch.equal(results[3][1][name], value), name
