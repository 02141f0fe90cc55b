"""autodist's plans train like one process: GPT-2, a Llama-style model (RMSNorm, rotary, GQA,
SwiGLU; `llama64`: RMSNorm in the input's dtype) and a CNN (ResNet), at 2 and 4 ranks, float64,
3 Adam steps, every parameter within 1e-10 of single-process training (as test_hf_parity).

Each plan is searched for real (ops profiled on this machine, the solver run); the collectives'
costs are given (`_comm_profile`) so the test does not also measure gloo. A plan is only useful
if it splits something: each case also checks the plan shards at least one parameter where the
cost model favours it (no memory limit given: a limit that excludes replication forces it).
"""
from __future__ import annotations

import pytest

import model_plans as mp
from launch import run_workers
from autodist_limits import tight_limit_gb
from test_hf_parity import _check, _sharded

COMM = {"backend": "given", "collectives": {c: {"2": [1e-5, 5e9], "4": [2e-5, 5e9]}
                                            for c in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")}}


def autodist(label, plan_ngpus, **pas):
    return mp.plan(label, "autodist", plan_ngpus, pas_config={"_comm_profile": COMM, **pas})


def tight(model, plan_ngpus, world):
    """A memory limit that replicated weights (with their Adam state) exceed: the plan must shard."""
    return {"mem_constraint": tight_limit_gb(model, plan_ngpus, world)}


def _run(world, cases, tmp_path):
    cases = [dict(c, label=c["label"] if c.get("train", True) else c["label"] + "-eval") for c in cases]
    for c in cases:
        c["train"] = c.get("train", True)
    results = run_workers(mp.run_plans, world, cases, str(tmp_path / "gen"), timeout=400)
    _check(results, cases)
    for c in cases:
        if c.get("sharded"):
            assert _sharded(results, c["label"]), f"{c['label']}: the plan shards no parameter"
        if c.get("pipelined"):  # each rank holds only its stage's parameters (a tied embedding: both)
            held = [{name for name, *_ in per_rank[c["label"]][1]} for per_rank in results[:2]]
            assert held[0] - held[1] and held[1] - held[0], f"{c['label']}: not cut into stages"


@pytest.mark.multiprocess
@pytest.mark.slow
def test_autodist_parity_2_ranks(tmp_path):
    _run(2, [dict(autodist("autodist-gpt2", 2), model="gpt2"),
             dict(autodist("autodist-gpt2-tight", 2, **tight("gpt2", 2, 2)), model="gpt2", sharded=True),
             dict(autodist("autodist-llama64-tight", 2, **tight("llama64", 2, 2)), model="llama64", sharded=True),
             dict(autodist("autodist-resnet", 2), model="resnet", train=False),
             # a pipeline of 2 stages, cut where a block starts (1f1b, 2 micro-batches)
             dict(mp.plan("autodist-gpt2-pp", "autodist", 2, use_end2end=True,
                          pas_config={"_comm_profile": COMM, "pipeline_pivots": "GPT2Block", "pipeline_nstages": 2,
                                      "pipeline_nmicros": mp.NMICROS}), model="gpt2", pipelined=True),
             dict(autodist("autodist-resnet-tight", 2, **tight("resnet", 2, 2)), model="resnet", train=False,
                  sharded=True)], tmp_path)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_autodist_parity_4_ranks(tmp_path):
    _run(4, [dict(autodist("autodist-llama64-4", 4, **tight("llama64", 4, 4)), model="llama64", sharded=True),
             dict(autodist("autodist-gpt2-2x2", 2, **tight("gpt2", 2, 4)), model="gpt2", sharded=True),
             dict(autodist("autodist-resnet-4", 4), model="resnet", train=False)], tmp_path)
