"""Parity of pipeline-parallel plans with single-process training, on real gloo processes.

`pp` with 2 and 4 stages under every training schedule (1f1b, 1f1b_plus, gpipe, chimera_direct
with 4 stages, 1f1b_interleaved with two stages per device), `hybrid` pp 2 x tp 2, pp 2 x dp 2
and hybrid pp 2 x tp 1 x dp 2, pp 2 x dp 2 with ZeRO-1 (all-reduce and reduce-scatter modes),
pp 2 with every Block recomputed in backward, on the GPT (its tied embedding / head lives on the
first and the last stage): after 5 Adam steps on the same global batch (``train_step`` with
``pipeline_nmicros`` micro-batches, gradients scaled by 1 / nmicros), every micro-batch loss on
every rank and every parameter (assembled from the ranks' shards; ranks holding the same slice
must agree exactly) within 1e-5 of single-process training. Then ``infer_step`` returns the
single-process per-micro losses of the trained model without touching gradients or weights.
Four cases clip gradients (``opt.clip_gnorm``: pp 2, hybrid pp 2 x tp 2, both ZeRO cases): its norm equals
the single-process one (the tied weight held by two stages, and replicated tensors, count once),
and an ``inference_only`` module with ``infer_pipe`` matches the untrained model. One spawn per
world size runs all its cases (spawning costs seconds per rank).
"""
from __future__ import annotations

import sys

import pytest
import torch

from gpt import GPT, GPTConfig, random_batch
from launch import run_workers
from parity import assemble_full
from nnscaler.runtime.optimizer_state import optimizer_state

STEPS = 5
GLOBAL_BATCH = 8
NMICROS = 4
LR = 1e-3
TOL = 1e-5
CLIP = 0.05  # small enough that clipping really scales the gradients
GPT_CFG = dict(vocab_size=32, block_size=8, n_layer=4, n_head=2, n_embd=16)
BLOCKS = {"pipeline_pivots": "Block"}


def _make():
    torch.manual_seed(0)
    return GPT(GPTConfig(**GPT_CFG))


def _batch(step, n):
    return random_batch(step, n, GPTConfig(**GPT_CFG))


def _case(label, policy, plan, pas, clip=False, nmicros=NMICROS, **cfg):
    return dict(label=label, policy=policy, plan=plan, clip=clip, cfg=cfg,
                pas={"pipeline_nmicros": nmicros, **pas})


def _pp(plan, scheduler, **extra):
    label = f"pp{plan}-{scheduler}" + "".join(f"-{k}{v}" for k, v in extra.items())
    return _case(label, "pp", plan, {"pipeline_scheduler": scheduler, **extra})


CASES = {
    2: [_pp(2, "1f1b"), _pp(2, "1f1b_plus"), _pp(2, "gpipe"),
        _pp(2, "1f1b_interleaved", pipeline_nstages=4),
        _case("pp2-1f1b-clip", "pp", 2, {"pipeline_scheduler": "1f1b"}, clip=True),
        # activation recomputation inside the stages (checkpointed blocks rerun in each backward)
        _case("pp2-1f1b-recompute", "pp", 2, {"pipeline_scheduler": "1f1b", "recompute_modules": "Block"})],
    4: [_pp(4, "1f1b"), _pp(4, "1f1b_plus"), _pp(4, "gpipe"), _pp(4, "chimera_direct"),
        _pp(4, "1f1b_interleaved", pipeline_nstages=8),
        _case("hybrid-pp2-tp2", "hybrid", 4, {**BLOCKS, "pipeline_nstages": 2, "pp_size": 2}),
        _case("hybrid-pp2-tp2-clip", "hybrid", 4, {**BLOCKS, "pipeline_nstages": 2, "pp_size": 2}, clip=True),
        _case("pp2-dp2", "pp", 2, {}),
        _case("hybrid-pp2-tp1-dp2", "hybrid", 2, {**BLOCKS, "pipeline_nstages": 2, "pp_size": 2}),
        # ZeRO-1 over the data-parallel replicas of each stage; the tied embedding / head (held by
        # both stages) keeps its own reducer, ZeRO only copies its owned ranges
        _case("pp2-dp2-zero-clip", "pp", 2, {}, clip=True, use_zero=True),
        _case("pp2-dp2-zero-rs-clip", "pp", 2, {"pipeline_scheduler": "gpipe"}, clip=True, use_zero=True,
              zero_use_reduce_scatter=True)],
}


def _micro_batches(batch, dp_rank, dp, nmicros):
    """This data-parallel replica's share of `batch`, cut into `nmicros` micro-batches."""
    per = len(batch["idx"]) // dp
    mine = {k: v[dp_rank * per:(dp_rank + 1) * per] for k, v in batch.items()}
    mb = per // nmicros
    return [{k: v[i * mb:(i + 1) * mb] for k, v in mine.items()} for i in range(nmicros)]


def _losses(outputs):
    return [float(o.reshape(())) for o in outputs]


# -- reference -----------------------------------------------------------------------------------
def reference(dp, nmicros, clip):
    """Single-process training on the global batch; per step, the loss of every micro-batch of
    every replica (before that step's update); after training the same for the evaluation
    batch, and the parameters."""
    model = _make()
    opt = torch.optim.Adam(model.parameters(), lr=LR)

    def micro_losses(batch):
        with torch.no_grad():
            return [[model(**mb).item() for mb in _micro_batches(batch, r, dp, nmicros)] for r in range(dp)]

    per_step, norms = [], []
    for step in range(STEPS):
        batch = _batch(step, GLOBAL_BATCH)
        per_step.append(micro_losses(batch))
        loss = model(**batch)
        opt.zero_grad()
        loss.backward()
        if clip:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
    evaluation = micro_losses(_batch(STEPS, GLOBAL_BATCH))
    return per_step, norms, evaluation, {k: v.detach().clone() for k, v in model.named_parameters()}


def reference_untrained(nmicros):
    model = _make()
    with torch.no_grad():
        return [model(**mb).item() for mb in _micro_batches(_batch(STEPS, GLOBAL_BATCH), 0, 1, nmicros)]


# -- workers -------------------------------------------------------------------------------------
def _train(rank, world, case, gen_dir):
    from nnscaler import ComputeConfig, build_optimizer, parallelize

    plan, nmicros = case["plan"], case["pas"]["pipeline_nmicros"]
    dp, dp_rank = world // plan, rank // plan
    cfg = ComputeConfig(plan, world, trace_strategy="cpu", use_end2end=True, pas_config=case["pas"], **case["cfg"])
    sample = _micro_batches(_batch(0, GLOBAL_BATCH), 0, dp, nmicros)[0]
    pm = parallelize(_make(), sample, case["policy"], cfg, gen_savedir=gen_dir,
                     instance_name=case["label"].replace("-", "_"))
    opt = build_optimizer(pm, torch.optim.Adam, lr=LR)
    losses, norms = [], []
    for step in range(STEPS):
        opt.zero_grad()
        outputs = pm.train_step(_micro_batches(_batch(step, GLOBAL_BATCH), dp_rank, dp, nmicros))
        opt.scale_grads(1.0 / nmicros)
        if case["clip"]:
            norms.append(opt.clip_gnorm(CLIP).item())
        opt.step()
        losses.append(_losses(outputs))

    params = [p for p in pm.parameters()]
    grads = [None if p.grad is None else p.grad.clone() for p in params]
    weights = [p.detach().clone() for p in params]
    evaluation = _losses(pm.infer_step(_micro_batches(_batch(STEPS, GLOBAL_BATCH), dp_rank, dp, nmicros)))
    untouched = (all((g is None and p.grad is None) or (g is not None and torch.equal(g, p.grad))
                     for p, g in zip(params, grads))
                 and all(torch.equal(p, w) for p, w in zip(params, weights)))

    zero = optimizer_state(opt).zero
    # ZeRO: (owned optimizer elements, local trainable elements, reduce-scatter buckets?) on this rank
    zero_shard = None if zero is None else (
        sum(p.stop - p.start for p in zero.layout.pieces), sum(p.numel() for p in params if p.requires_grad),
        zero.layout.reduce_scatter,
        sorted(pm.fullmap[t[1]].full_name for b in zero.layout.buckets if not b.reduce_scatter for t in b.tensors))
    shards = [(e.full_name, e.full_shape, e.slices, getattr(pm, local).detach().clone())
              for local, e in pm.fullmap.items() if isinstance(getattr(pm, local), torch.nn.Parameter)]
    code = open(sys.modules[type(pm).__module__].__file__).read()
    return dict(losses=losses, norms=norms, evaluation=evaluation, infer_untouched=untouched, shards=shards,
                zero_shard=zero_shard, recomputed="torch.utils.checkpoint.checkpoint(" in code)


def _infer_only(rank, world, gen_dir):
    """A 2-stage inference_only module on `infer_pipe`: per-micro losses of the untrained model."""
    from nnscaler import ComputeConfig, parallelize

    pas = {"pipeline_nmicros": NMICROS, "pipeline_scheduler": "infer_pipe"}
    cfg = ComputeConfig(2, world, trace_strategy="cpu", use_end2end=True, inference_only=True, pas_config=pas)
    samples = _micro_batches(_batch(STEPS, GLOBAL_BATCH), 0, 1, NMICROS)
    pm = parallelize(_make(), samples[0], "pp", cfg, gen_savedir=gen_dir, instance_name="infer_pipe")
    outputs = pm.infer_step(samples)
    return _losses(outputs), all(o.grad_fn is None for o in outputs)


def run_cases(rank, world, gen_dir):
    results = {case["label"]: _train(rank, world, case, gen_dir) for case in CASES[world]}
    if world == 2:
        results["infer_pipe"] = _infer_only(rank, world, gen_dir)
    return results


# -- checks --------------------------------------------------------------------------------------
def assemble(results, label):
    return assemble_full(((r, per_rank[label]["shards"]) for r, per_rank in enumerate(results)), label)


def _close(got, want):
    return abs(got - want) <= TOL * max(1.0, abs(want))


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 4])
def test_pipeline_parallel_parity(world, tmp_path):
    results = run_workers(run_cases, world, str(tmp_path / "gen"), timeout=400)
    refs = {}
    for case in CASES[world]:
        label, plan, nmicros = case["label"], case["plan"], case["pas"]["pipeline_nmicros"]
        dp = world // plan
        key = (dp, nmicros, case["clip"])
        if key not in refs:
            refs[key] = reference(*key)
        ref_steps, ref_norms, ref_eval, ref_params = refs[key]
        for rank, per_rank in enumerate(results):
            got = per_rank[label]
            for step in range(STEPS):
                want = ref_steps[step][rank // plan]
                assert len(got["losses"][step]) == nmicros, f"{label} rank {rank}: {len(got['losses'][step])} outputs"
                assert all(map(_close, got["losses"][step], want)), \
                    f"{label} rank {rank} step {step}: micro losses {got['losses'][step]} vs {want}"
            assert all(map(_close, got["norms"], ref_norms)) and len(got["norms"]) == len(ref_norms), \
                f"{label} rank {rank}: clip_gnorm norms {got['norms']} vs {ref_norms}"
            want = ref_eval[rank // plan]
            assert all(map(_close, got["evaluation"], want)), \
                f"{label} rank {rank}: infer_step losses {got['evaluation']} vs {want}"
            assert got["infer_untouched"], f"{label} rank {rank}: infer_step changed gradients or weights"
            assert got["recomputed"] == ("recompute_modules" in case["pas"]), f"{label} rank {rank}: checkpointing"
            if case["cfg"].get("use_zero"):  # each of the dp replicas owns about 1 / dp of its stage's state
                owned, local, reduce_scatter, copied = got["zero_shard"]
                assert local / dp - 64 <= owned <= local / dp + 64, f"{label} rank {rank}: owns {owned} of {local}"
                assert reduce_scatter == case["cfg"].get("zero_use_reduce_scatter", False), label
                if reduce_scatter:  # the tied weight (both stages) is averaged by its own reducer: not again
                    assert copied == ["wte.weight"], f"{label} rank {rank}: copied, not reduced: {copied}"
            else:
                assert got["zero_shard"] is None, label
        params = assemble(results, label)
        assert set(params) == set(ref_params), f"{label}: {sorted(set(params) ^ set(ref_params))}"
        for name, value in params.items():
            assert not torch.isnan(value).any(), f"{label}: parts of {name} are held by no rank"
            diff = (value - ref_params[name]).abs().max().item()
            assert diff <= TOL, f"{label} world={world}: {name} differs by {diff}"
    if world == 2:
        want = reference_untrained(NMICROS)
        for rank, (losses, detached) in enumerate(r["infer_pipe"] for r in results):
            assert all(map(_close, losses, want)), f"infer_pipe rank {rank}: {losses} vs {want}"
            assert detached, f"infer_pipe rank {rank}: infer_step outputs carry autograd history"
