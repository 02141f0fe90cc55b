"""Parity of tensor-parallel plans with single-process training, on real gloo processes.

`tp` (plan_ngpus 2 and 4), the Megatron-style policy (plan_ngpus 2), `data`, and tp 2 x dp 2
(runtime_ngpus 4), on the MLP, the GPT with tied embedding/head, a small CNN and a distillation
model whose teacher runs under torch.no_grad() (it must get no gradient, so no update): losses and
every parameter (assembled from the ranks' shards) after 5 Adam steps within 1e-5.
"""
from __future__ import annotations

import pytest
import torch

import toy_models
from gpt import GPT, GPTConfig, random_batch
from launch import run_workers
from parity import assemble_full, train_steps

STEPS = 5
GLOBAL_BATCH = 8
LR = 1e-3
TOL = 1e-5
CLIP = 0.05  # small enough that clipping really scales the gradients
GPT_CFG = dict(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)


def _make(name):
    torch.manual_seed(0)
    if name == "gpt":
        return GPT(GPTConfig(**GPT_CFG))
    return {"mlp": toy_models.MLP, "cnn": toy_models.SmallCNN, "fanout": toy_models.FanOut,
            "distill": toy_models.Distill}[name]()


def _batch(name, step, n):
    if name == "gpt":
        return random_batch(step, n, GPTConfig(**GPT_CFG))
    if name == "cnn":
        return toy_models.cnn_batch(step, n)
    return toy_models.mlp_batch(step, n)


def _clips(policy):
    return policy == "megatron"


# Which linears the Megatron-style policy splits by columns / rows, per model (GPT: defaults).
MEGATRON_LAYERS = {"mlp": {"column": ["layers.0", "layers.2"], "row": ["layers.1"]},
                   "cnn": {"column": ["head"], "row": []}}


def reference(name, clip):
    model = _make(name)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        loss = model(**_batch(name, step, GLOBAL_BATCH))
        opt.zero_grad()
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def train(rank, world, name, policy, plan, gen_dir):
    from nnscaler import ComputeConfig, build_optimizer, parallelize

    dp = world // plan
    per = GLOBAL_BATCH // dp
    dp_rank = rank // plan
    pas_config = MEGATRON_LAYERS.get(name, {}) if policy == "megatron" else {}
    cfg = ComputeConfig(plan, world, trace_strategy="cpu", pas_config=pas_config)
    pm = parallelize(_make(name), _batch(name, 0, per), policy, cfg,
                     gen_savedir=gen_dir, instance_name=f"{name}_{policy}_{plan}_{world}")
    opt = build_optimizer(pm, torch.optim.Adam, lr=LR)
    losses = train_steps(pm, opt, lambda step, n: _batch(name, step, n), steps=STEPS, global_batch=GLOBAL_BATCH,
                         dp_rank=dp_rank, dp=dp, clip=CLIP if _clips(policy) else None)
    shards = [(e.full_name, e.full_shape, e.slices, getattr(pm, local).detach().clone())
              for local, e in pm.fullmap.items() if isinstance(getattr(pm, local), torch.nn.Parameter)]
    return losses, shards


FAN_OUT = "toy_models.fan_out_policy"  # a user policy, by dotted path
CASES = {2: [("mlp", "tp", 2), ("gpt", "tp", 2), ("cnn", "tp", 2), ("gpt", "megatron", 2), ("gpt", "data", 2),
             ("fanout", FAN_OUT, 2), ("mlp", "megatron", 2), ("cnn", "megatron", 2), ("distill", "tp", 2)],
         4: [("mlp", "tp", 4), ("gpt", "tp", 4), ("cnn", "tp", 4),
             ("mlp", "tp", 2), ("gpt", "tp", 2), ("cnn", "tp", 2), ("gpt", "megatron", 2)]}


def run_cases(rank, world, gen_dir):
    return {case: train(rank, world, *case, gen_dir) for case in CASES[world]}


def assemble(results, case):
    return assemble_full(((r, per_rank[case][1]) for r, per_rank in enumerate(results)), case)


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_parity(world, tmp_path):
    results = run_workers(run_cases, world, str(tmp_path / "gen"), timeout=400)
    refs = {}
    for case in CASES[world]:
        name, policy, plan = case
        key = (name, _clips(policy))
        if key not in refs:
            refs[key] = reference(name, _clips(policy))
        ref_losses, ref_params = refs[key]
        losses = results[0][case][0]
        for step, (got, want) in enumerate(zip(losses, ref_losses)):
            assert abs(got - want) <= TOL * max(1.0, abs(want)), f"{case} world={world} step {step}: {got} vs {want}"
        params = assemble(results, case)
        assert set(params) == {n for n in ref_params if n in params} and len(params) >= len(ref_params) - 1
        for pname, value in params.items():
            assert not torch.isnan(value).any(), f"{case}: parts of {pname} are held by no rank"
            diff = (value - ref_params[pname]).abs().max().item()
            assert diff <= TOL, f"{case} world={world}: {pname} differs by {diff}"
