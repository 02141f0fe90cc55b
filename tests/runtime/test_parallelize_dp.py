"""Parity of `parallelize(..., 'dp', ...)` with single-process training, on real gloo processes.

One spawned job per world size runs every case (models x plain loop / end2end train_step), so
the cost of starting processes is paid once. Each case trains 5 Adam steps from the same initial
weights as the single-process reference; the mean loss of every step and every parameter at the
end must match within 1e-5.
"""
from __future__ import annotations

import pytest
import torch

import toy_models
from gpt import GPT, GPTConfig, random_batch
from launch import run_workers
from parity import train_steps

STEPS = 5
GLOBAL_BATCH = 8
LR = 1e-3
TOL = 1e-5

GPT_CFG = dict(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)


def _make(name):
    torch.manual_seed(0)
    if name == "gpt":
        return GPT(GPTConfig(**GPT_CFG))
    if name == "gpt_sdpa":
        return GPT(GPTConfig(**GPT_CFG, use_sdpa=True))
    return {"mlp": toy_models.MLP, "tied_frozen": toy_models.TiedFrozen,
            "custom_op": toy_models.CustomOpModel}[name]()


def _batch(name, step, n):
    if name.startswith("gpt"):
        return random_batch(step, n, GPTConfig(**GPT_CFG))
    return toy_models.mlp_batch(step, n)


CASES = [("mlp", "plain"), ("mlp", "end2end"), ("gpt", "plain"), ("gpt", "end2end"),
         ("gpt_sdpa", "plain"), ("tied_frozen", "plain"), ("custom_op", "end2end"), ("gpt", "async")]
# the async case overlaps the all-reduce of many small buckets with the rest of backward
ASYNC_CFG = dict(use_async_reducer=True, reducer_bucket_cap_mb=0.004)


def reference(name):
    model = _make(name)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses = []
    for step in range(STEPS):
        loss = model(**_batch(name, step, GLOBAL_BATCH))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    return losses, {k: v.detach().clone() for k, v in tensors.items()}


def train_case(rank, world, name, mode, gen_dir):
    from nnscaler import ComputeConfig, build_optimizer, parallelize

    per = GLOBAL_BATCH // world
    extra = ASYNC_CFG if mode == "async" else {}
    cfg = ComputeConfig(1, world, use_end2end=mode == "end2end", trace_strategy="cpu", **extra)
    pm = parallelize(_make(name), _batch(name, 0, per), "dp", cfg, gen_savedir=gen_dir,
                     instance_name=f"{name}_{mode}")
    opt = build_optimizer(pm, torch.optim.Adam, lr=LR)
    losses = train_steps(pm, opt, lambda step, n: _batch(name, step, n), steps=STEPS, global_batch=GLOBAL_BATCH,
                         dp_rank=rank, dp=world, end2end=mode == "end2end")
    params = {rec.full_name: getattr(pm, local).detach().clone() for local, rec in pm.fullmap.items()}
    n_opt = sum(p.numel() for g in opt.param_groups for p in g["params"])
    if mode == "async":  # several buckets, each all-reduced once per step
        assert pm.reducer.stats.allreduce_calls >= 3 * STEPS, pm.reducer.stats
    return losses, params, n_opt


def run_all_cases(rank, world, gen_dir):
    return {f"{name}/{mode}": train_case(rank, world, name, mode, gen_dir) for name, mode in CASES}


@pytest.fixture(scope="module")
def references():
    return {name: reference(name) for name in {n for n, _ in CASES}}


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 4])
def test_dp_parity_with_single_process(world, tmp_path, references):
    results = run_workers(run_all_cases, world, str(tmp_path / "gen"), timeout=300)
    for key in results[0]:
        name = key.split("/")[0]
        ref_losses, ref_params = references[name]
        losses, params, n_opt = results[0][key]
        for step, (got, want) in enumerate(zip(losses, ref_losses)):
            assert abs(got - want) <= TOL * max(1.0, abs(want)), f"{key} world={world} step {step}: {got} vs {want}"
        assert set(params) == set(ref_params), key
        for pname, value in params.items():
            diff = (value.double() - ref_params[pname].double()).abs().max().item()
            assert diff <= TOL, f"{key} world={world}: parameter {pname} differs by {diff}"
        # replicas hold identical parameters
        for other in results[1:]:
            for pname, value in other[key][1].items():
                assert torch.equal(value, params[pname]), f"{key}: replicas disagree on {pname}"
    # frozen parameters are neither trained nor handed to the optimizer; tied ones are one tensor
    _, ref_params = references["tied_frozen"]
    losses, params, n_opt = results[0]["tied_frozen/plain"]
    model = _make("tied_frozen")
    assert torch.equal(params["frozen.weight"], model.frozen.weight)
    trainable = {id(p): p for p in model.parameters() if p.requires_grad}
    assert n_opt == sum(p.numel() for p in trainable.values())
    assert "tail.weight" not in params and "shared_again.weight" not in params  # aliases, not copies
