"""The plan search (nnscaler.policies.estimate.search): the fastest plan that fits, each runner-up
with its reason, clear errors, and the trillion-parameter case on 3,072 GPUs (it finishes; the time
is in bench/results/plan_estimate.json)."""
from __future__ import annotations

import dataclasses

import pytest

from nnscaler.ir import ConfigError
from nnscaler.policies.estimate import (ModelSpec, NoPlanFitsCluster, Workload, estimate_plan, load_cluster, search)
from nnscaler.policies.estimate.search import candidates

SMALL = ModelSpec(hidden=2048, layers=16, heads=16, kv_heads=16, head_dim=128, ffn=5504, vocab=32000)


def test_best_is_the_fastest_that_fits():
    a100 = load_cluster("a100-80gb-sxm")
    work = Workload(gpus=16, seq=2048, global_batch_tokens=256 * 2048)
    result = search(SMALL, a100, work)
    every = [estimate_plan(SMALL, a100, work, p) for p in candidates(SMALL, a100, work)]
    assert result.evaluated == len(every)
    assert result.best.step_s == min(e.step_s for e in every if e.fits)
    for plan in (e.plan for e in every):
        assert plan.tp * plan.pp * plan.dp == 16 and plan.tp <= 8 and SMALL.heads % plan.tp == 0
    assert all(reason for _, reason in result.runners_up)
    families = [(e.plan.tp, e.plan.pp) for e, _ in result.runners_up]
    assert len(families) == len(set(families)) and (result.best.plan.tp, result.best.plan.pp) not in families


def test_memory_decides_and_is_named_as_the_reason():
    a100 = load_cluster("a100-80gb-sxm")
    small_gpu = dataclasses.replace(a100, gpu=dataclasses.replace(a100.gpu, memory_gb=4))
    work = Workload(gpus=8, seq=2048, global_batch_tokens=64 * 2048)
    result = search(SMALL, small_gpu, work, fixed={"zero": 1})  # (ZeRO-3 plans fit: the runners-up would all fit)
    assert result.best.fits and result.best.memory_gb <= 4
    lost_on_memory = [reason for e, reason in result.runners_up if not e.fits]
    assert lost_on_memory and all(r.startswith("memory: needs") for r in lost_on_memory)
    tiny_gpu = dataclasses.replace(a100, gpu=dataclasses.replace(a100.gpu, memory_gb=0.05))
    with pytest.raises(NoPlanFitsCluster, match="no plan fits 0.05 GB per GPU .*the smallest, .* needs"):
        search(SMALL, tiny_gpu, work)


def test_bad_workloads():
    h100 = load_cluster("h100-sxm")
    with pytest.raises(ConfigError, match="--global-batch-tokens .* multiple of --seq-len"):
        search(SMALL, h100, Workload(gpus=8, seq=2048, global_batch_tokens=1000))
    with pytest.raises(ConfigError, match=r"--gpus \(12\) must fill whole nodes of 8"):
        search(SMALL, h100, Workload(gpus=12, seq=2048, global_batch_tokens=12 * 2048))
    with pytest.raises(NoPlanFitsCluster, match="no plan splits this model over 8 GPUs"):
        # 3 heads: no tensor parallelism over 8; 4 layers: at most 4 stages; then dp >= 2 divides no 3 sequences
        search(dataclasses.replace(SMALL, heads=3, kv_heads=3, layers=4), h100,
               Workload(gpus=8, seq=2048, global_batch_tokens=3 * 2048))


def test_fixed_fields():
    result = search(SMALL, load_cluster("h100-sxm"), Workload(gpus=16, seq=2048, global_batch_tokens=64 * 2048),
                    fixed={"tp": 2, "pp": 2})
    assert (result.best.plan.tp, result.best.plan.pp, result.best.plan.dp) == (2, 2, 4)


def test_a_trillion_parameters_on_3072_gpus():
    """Megatron-LM's 1T GPT (Narayanan et al. 2021) on 3,072 A100s: the search finishes with a
    plan that keeps tensor parallelism inside the node and fits."""
    spec = ModelSpec(hidden=25600, layers=128, heads=160, kv_heads=160, head_dim=160, ffn=4 * 25600, vocab=51200,
                     gated=False)
    assert 1.0e12 < spec.total_params < 1.02e12
    result = search(spec, load_cluster("a100-80gb-sxm"), Workload(gpus=3072, seq=2048, global_batch_tokens=3072 * 2048))
    plan = result.best.plan
    assert plan.tp * plan.pp * plan.dp == 3072 and plan.tp <= 8 and plan.pp > 1 and result.best.fits
    assert 0 < result.best.mfu < 1 and result.evaluated > 100


def test_why_a_plan_lost():
    from nnscaler.policies.estimate import Plan
    from nnscaler.policies.estimate.search import why_lost
    h100 = load_cluster("h100-sxm")
    work = Workload(gpus=2, seq=2048, global_batch_tokens=8 * 2048)
    dp = estimate_plan(SMALL, h100, work, Plan(1, 1, 2, 0, 1, False))
    pp = estimate_plan(SMALL, h100, work, Plan(1, 2, 1, 0, 1, False))
    assert why_lost(pp, dp, h100).startswith("bubble: +")
    from nnscaler.policies.estimate import Link
    slow = dataclasses.replace(h100, intra_node=Link(10, 3))  # a slow link inside the node
    dp_slow = estimate_plan(SMALL, slow, work, Plan(1, 1, 2, 0, 1, False))
    tp_slow = estimate_plan(SMALL, slow, work, Plan(2, 1, 1, 0, 1, False))
    assert why_lost(tp_slow, dp_slow, slow).startswith("communication: +")
    # on NVLink tensor parallelism loses on its twice as many, half-size kernels instead
    tp = estimate_plan(SMALL, h100, work, Plan(2, 1, 1, 0, 1, False))
    assert why_lost(tp, dp, h100).startswith("compute: +")
    assert why_lost(dp, dp, h100) == "ties the chosen plan"


# A 70B Llama-like model on 16 H100s, 8 sequences a step: without a pipeline, ZeRO-1 fits at no dp
LLAMA_70B = ModelSpec(hidden=8192, layers=80, heads=64, kv_heads=8, head_dim=128, ffn=28672, vocab=128256, gated=True)


def test_zero3_is_chosen_where_zero1_does_not_fit():
    h100 = load_cluster("h100-sxm")
    work = Workload(gpus=16, seq=4096, global_batch_tokens=8 * 4096)
    with pytest.raises(NoPlanFitsCluster, match="no plan fits"):
        search(LLAMA_70B, h100, work, fixed={"pp": 1, "zero": 1})
    best = search(LLAMA_70B, h100, work, fixed={"pp": 1}).best
    assert best.fits and best.plan.zero == 3 and best.plan.pp == 1
    same_zero1 = estimate_plan(LLAMA_70B, h100, work, dataclasses.replace(best.plan, zero=1))
    assert not same_zero1.fits and best.memory_bytes < same_zero1.memory_bytes
    # its gathers are the price: per micro-batch one exposed pass (ZeRO-1: one after the step)
    assert best.dp_comm_s >= same_zero1.dp_comm_s
    more_micros = estimate_plan(LLAMA_70B, h100, Workload(gpus=16, seq=4096, global_batch_tokens=32 * 4096),
                                best.plan)
    assert more_micros.nmicros > 1 and more_micros.dp_comm_s > estimate_plan(
        LLAMA_70B, h100, Workload(gpus=16, seq=4096, global_batch_tokens=32 * 4096),
        dataclasses.replace(best.plan, zero=1)).dp_comm_s


def test_zero3_is_searched_with_and_without_a_pipeline():
    a100 = load_cluster("a100-80gb-sxm")
    work = Workload(gpus=16, seq=2048, global_batch_tokens=256 * 2048)
    plans = list(candidates(SMALL, a100, work))
    assert all(p.dp > 1 for p in plans if p.zero == 3)
    assert {p.zero for p in plans if p.dp > 1 and p.pp > 1} == {p.zero for p in plans if p.dp > 1 and p.pp == 1} \
        == {0, 1, 3}
    staged = next(p for p in plans if p.zero == 3 and p.pp > 1)
    one = dataclasses.replace(staged, zero=1)
    assert estimate_plan(SMALL, a100, work, staged).memory_bytes < estimate_plan(SMALL, a100, work, one).memory_bytes


def test_zero3_plan_json_and_trainer_fragment(capsys):
    from nnscaler.ir import ComputeConfig
    from nnscaler.policies.estimate import result_json
    from nnscaler.policies.estimate.cli import _print
    h100 = load_cluster("h100-sxm")
    work = Workload(gpus=16, seq=4096, global_batch_tokens=8 * 4096)
    data = result_json(search(LLAMA_70B, h100, work, fixed={"pp": 1}), LLAMA_70B, h100, work)
    assert data["zero"] == 3 and data["zero_ngroups"] == 1
    compute = data["trainer"]["compute_config"]
    assert compute["use_zero"] == 3 and "zero_use_reduce_scatter" not in compute
    assert ComputeConfig(**compute).zero_stage == 3
    assert data["memory_parts_gb"]["gathered"] > 0
    _print(data, None)
    out = capsys.readouterr().out
    assert "dp 2, zero 3, micro-batch" in out and '"use_zero": 3' in out
