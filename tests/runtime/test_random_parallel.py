"""Random streams on real gloo processes (runtime/random.py; docs/tracing.md "Random numbers").

* rng_mode "parallel", on the toy GPT of random_models.py and on transformers' GPT-2, dropouts on,
  every rank seeded differently (torch.manual_seed(1 + rank), the quick start's pattern): after a
  few Adam steps the replicated parameters are bitwise identical on the ranks of a unit (megatron
  2, tp 2, data 2, tp 2 x dp 2, hybrid pp 2 x tp 2); a random op split over the unit draws a different
  piece per rank; different data-parallel replicas draw different masks; recomputed
  (checkpointed) blocks redraw the same masks under megatron.
* rng_mode "exact" (float64): dp 2, tp 2, megatron 2, dp 2 + ZeRO and tp 2 x dp 2 (and tp 2 on
  transformers' GPT-2) match one process trained on the global batch after
  torch.manual_seed(SEED), dropout on (and, on a small model, randn_like noise and dropout1d):
  losses and every parameter within 1e-10.
"""
from __future__ import annotations

import pytest
import torch

import random_models
from launch import run_workers
from parity import assemble_full, train_steps

STEPS = 3
GLOBAL_BATCH = 8
LR = 1e-2
SEED = 1234
TOL = 1e-10


MODELS = {"gpt": (random_models.make, random_models.batch),
          "noisy": (random_models.make_noisy, random_models.noisy_batch),
          "hf_gpt2": (random_models.make_hf_gpt2, random_models.batch)}  # transformers' GPT-2, dropout on


def _params(pm):
    return [(e.full_name, e.full_shape, e.slices, getattr(pm, local).detach().clone())
            for local, e in pm.fullmap.items() if isinstance(getattr(pm, local), torch.nn.Parameter)]


def _build(model_name, policy, plan, world, gen_dir, name, rng_mode="parallel", user_seed=None, **cfg):
    from nnscaler import ComputeConfig, parallelize
    make, batch = MODELS[model_name]
    config = ComputeConfig(plan, world, trace_strategy="cpu", rng_mode=rng_mode, **cfg)
    model = make()
    if user_seed is not None:
        torch.manual_seed(user_seed)
    return parallelize(model, batch(0, GLOBAL_BATCH // (world // plan)), policy,
                       config, gen_savedir=gen_dir, instance_name=name)


def _assemble(results, label):
    """assemble_full in float64 (the models run in float64): replicas must agree bitwise."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        return assemble_full(results, label)
    finally:
        torch.set_default_dtype(default)


def _gather(t):
    import torch.distributed as dist
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return out


# -- parallel mode ---------------------------------------------------------------------------------
def replicas_case(rank, world, model_name, policy, plan, recompute, gen_dir):
    import nnscaler.runtime as nr
    from nnscaler import build_optimizer
    pas = {"recompute_modules": "Block"} if recompute else {}
    # a different user seed per rank, before and after construction: must not matter
    pm = _build(model_name, policy, plan, world, gen_dir, f"{model_name}_{policy}{plan}_{world}_{recompute}",
                user_seed=1 + rank, pas_config=pas)
    torch.manual_seed(1 + rank)
    opt = build_optimizer(pm, torch.optim.Adam, lr=LR)
    dp = world // plan
    batch = MODELS[model_name][1]
    losses = train_steps(pm, opt, batch, steps=STEPS, global_batch=GLOBAL_BATCH, dp_rank=rank // plan, dp=dp)
    # dropout is really on: the same batch gives two different losses
    b = batch(0, GLOBAL_BATCH // dp)
    with torch.no_grad():
        active = pm(**b).item() != pm(**b).item()
    # direct draws: replicated (the stream) and split (shard_stream) over the unit
    with pm.rng_scope():
        replicated = torch.rand(64, dtype=torch.float64)
        with nr.random.shard_stream(pm, plan):
            split = torch.rand(64, dtype=torch.float64)
        after = torch.rand(64, dtype=torch.float64)  # the stream stays in step after a split op
    return dict(losses=losses, params=_params(pm), active=active, seed=pm.initial_seed(),
                draws=[_gather(x) for x in (replicated, split, after)])


def pipeline_case(rank, world, gen_dir):
    """hybrid pp 2 x tp 2 (each stage's ops split over its two devices), 2 micro-batches, blocks
    recomputed: the stage forwards run inside the module's stream."""
    from nnscaler import ComputeConfig, build_optimizer, parallelize
    pas = {"pipeline_pivots": "Block", "pipeline_nstages": 2, "pp_size": 2, "pipeline_nmicros": 2,
           "recompute_modules": "Block"}
    cfg = ComputeConfig(4, world, trace_strategy="cpu", use_end2end=True, pas_config=pas)
    pm = parallelize(random_models.make(), random_models.batch(0, 4), "hybrid", cfg, gen_savedir=gen_dir,
                     instance_name="hybrid")
    torch.manual_seed(1 + rank)
    user = torch.get_rng_state()
    opt = build_optimizer(pm, torch.optim.Adam, lr=LR)
    micro = [random_models.batch(0, 4), random_models.batch(1, 4)]
    for step in range(STEPS):
        opt.zero_grad()
        pm.train_step([random_models.batch(step, 4), random_models.batch(step + 100, 4)])
        opt.step()
    active = [o.item() for o in pm.infer_step(micro)] != [o.item() for o in pm.infer_step(micro)]
    # the stages drew from the module's stream, not from the user's generator
    untouched = torch.equal(torch.rand(8), torch.rand(8, generator=torch.Generator().set_state(user)))
    return dict(params=_params(pm), active=active, untouched=untouched)


CASES = {2: [("gpt", "megatron", 2, False), ("gpt", "tp", 2, False), ("gpt", "megatron", 2, True),
             ("gpt", "data", 2, False), ("hf_gpt2", "tp", 2, False)],
         4: [("gpt", "tp", 2, False)]}


def run_replicas(rank, world, gen_dir):
    out = {case: replicas_case(rank, world, *case, gen_dir) for case in CASES[world]}
    if world == 4:
        out["hybrid"] = pipeline_case(rank, world, gen_dir)
    return out


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_replicas_stay_identical_whatever_the_user_seeds(world, tmp_path):
    results = run_workers(run_replicas, world, str(tmp_path / "gen"), timeout=500)
    for case in CASES[world]:
        _, policy, plan, _ = case
        per_rank = [r[case] for r in results]
        assert all(r["active"] for r in per_rank), f"{case}: dropout is not active"
        assert [r["seed"] for r in per_rank] == [1] * world, f"{case}: the seed is not rank 0's"
        # assemble_full asserts that ranks holding the same slice (replicas) agree bitwise
        full = _assemble(((rank, r["params"]) for rank, r in enumerate(per_rank)), str(case))
        assert all(not torch.isnan(v).any() for v in full.values())
        replicated, split, after = per_rank[0]["draws"]
        for unit in range(world // plan):
            ranks = range(unit * plan, (unit + 1) * plan)
            for r in ranks:
                assert torch.equal(replicated[r], replicated[unit * plan]), f"{case}: rank {r} left its unit's stream"
                assert torch.equal(after[r], after[unit * plan]), f"{case}: rank {r} out of step after a split op"
            pieces = [split[r] for r in ranks]
            assert all(not torch.equal(pieces[0], p) for p in pieces[1:]), f"{case}: split pieces repeat"
        if world // plan > 1:  # data-parallel replicas draw their own masks
            assert not torch.equal(replicated[0], replicated[plan]), f"{case}: dp replicas share a stream"
    if world == 4:  # pipeline stages: the two devices of a stage hold identical replicas
        per_rank = [r["hybrid"] for r in results]
        assert all(r["active"] for r in per_rank), "hybrid: dropout is not active"
        assert all(r["untouched"] for r in per_rank), "hybrid: the stages drew from the user's generator"
        _assemble(((rank, r["params"]) for rank, r in enumerate(per_rank)), "hybrid pp2 x tp2")
        replicated = [n for n, shape, slices, _ in per_rank[0]["params"] if list(slices) == [(0, d) for d in shape]]
        assert replicated, "hybrid: no replicated parameter to compare"
    # recomputing the blocks in backward redraws the same masks: same training as without
    no_rc, rc = results[0].get(("gpt", "megatron", 2, False)), results[0].get(("gpt", "megatron", 2, True))
    if no_rc is not None:
        assert no_rc["losses"] == rc["losses"]
        for (name, _, slices, a), (_, _, _, b) in zip(no_rc["params"], rc["params"]):
            assert torch.equal(a, b), f"recompute changed {name}{slices}"


# -- exact mode ------------------------------------------------------------------------------------


def reference(name):
    make, batch = MODELS[name]
    model = make()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    torch.manual_seed(SEED)  # what pm.manual_seed(SEED) stands for
    losses = []
    for step in range(STEPS):
        loss = model(**batch(step, GLOBAL_BATCH))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def exact_case(rank, world, name, policy, plan, zero, gen_dir):
    from nnscaler import build_optimizer
    pm = _build(name, policy, plan, world, gen_dir, f"exact_{name}_{policy}{plan}_{world}_{zero}", rng_mode="exact",
                user_seed=1 + rank, use_zero=zero)
    pm.manual_seed(SEED)
    opt = build_optimizer(pm, torch.optim.Adam, lr=LR)
    losses = train_steps(pm, opt, MODELS[name][1], steps=STEPS, global_batch=GLOBAL_BATCH,
                         dp_rank=rank // plan, dp=world // plan)
    return losses, _params(pm)


EXACT = {2: [("gpt", "dp", 1, False), ("gpt", "tp", 2, False), ("gpt", "megatron", 2, False),
             ("gpt", "dp", 1, True), ("noisy", "dp", 1, False), ("noisy", "tp", 2, False),
             ("hf_gpt2", "tp", 2, False)],
         4: [("gpt", "tp", 2, False), ("gpt", "megatron", 2, False), ("noisy", "tp", 2, False)]}


def run_exact(rank, world, gen_dir):
    return {case: exact_case(rank, world, *case, gen_dir) for case in EXACT[world]}


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_exact_mode_matches_one_process_with_dropout(world, tmp_path):
    refs = {name: reference(name) for name in {case[0] for case in EXACT[world]}}
    results = run_workers(run_exact, world, str(tmp_path / "gen"), timeout=500)
    for case in EXACT[world]:
        ref_losses, ref_params = refs[case[0]]
        losses = results[0][case][0]
        for step, (got, want) in enumerate(zip(losses, ref_losses)):
            assert abs(got - want) <= TOL * max(1.0, abs(want)), f"{case} step {step}: {got} vs {want}"
        full = _assemble(((r, res[case][1]) for r, res in enumerate(results)), str(case))
        assert set(full) == set(ref_params)
        for name, value in full.items():
            rel = ((value - ref_params[name]).norm() / ref_params[name].norm()).item()
            assert rel <= TOL, f"{case}: {name} differs by {rel:.3g} (relative)"
