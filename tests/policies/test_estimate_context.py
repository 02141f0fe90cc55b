"""Context parallelism in ``nnscaler plan estimate`` (nnscaler.policies.estimate.context): activations
and compute per rank over cp, the ring's blocks, their link and what attention hides, the gradients
over dp·cp, the search's cp options, Llama 3 405B at 131,072 tokens on 16,384 H100s, the Trainer
fragment, the CLI and each error."""
from __future__ import annotations

import dataclasses
import json

import pytest
from typer.testing import CliRunner

from nnscaler.cli.main import app
from nnscaler.ir import ConfigError
from nnscaler.policies.estimate import (ModelSpec, NoPlanFitsCluster, Plan, Workload, costs, estimate_plan,
                                        load_cluster, result_json, search)
from nnscaler.policies.estimate import context
from nnscaler.policies.estimate.plan_cost import _layer_times
from nnscaler.policies.estimate.report import sequences_per_step, trainer_fragment
from nnscaler.policies.estimate.search import candidates

SPEC = ModelSpec(hidden=1024, layers=4, heads=16, kv_heads=4, head_dim=64, ffn=4096, vocab=32000)
LLAMA3_405B = {"model_type": "llama", "hidden_size": 16384, "num_hidden_layers": 126, "num_attention_heads": 128,
               "num_key_value_heads": 8, "intermediate_size": 53248, "vocab_size": 128256}


@pytest.fixture(scope="module")
def h100():
    return load_cluster("h100-sxm")


@pytest.fixture(scope="module")
def llama405b(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama") / "config.json"
    path.write_text(json.dumps(LLAMA3_405B))
    return ModelSpec.from_hf_config(path, meta=False)  # the analytic count equals the meta model's here


# -- the cost model ------------------------------------------------------------------------------
def test_activations_per_rank_are_divided_by_cp(h100):
    work = Workload(gpus=4, seq=16384, global_batch_tokens=16384)
    one = estimate_plan(SPEC, h100, dataclasses.replace(work, gpus=1), Plan(1, 1, 1, 0, 1, False))
    four = estimate_plan(SPEC, h100, work, Plan(1, 1, 1, 0, 1, False, cp=4))
    per_layer = 16384 * SPEC.act_elements_per_token() * 2
    assert one.memory_parts["activations"] == pytest.approx(4 * per_layer)
    assert four.memory_parts["activations"] == pytest.approx(4 * per_layer / 4)
    assert four.memory_parts["weights"] == one.memory_parts["weights"]  # cp ranks hold replicas
    ring = 4 * context.kv_block_bytes(SPEC, 1, 16384, 1, 4, 2)  # the K/V blocks in flight
    assert four.memory_parts["transient"] - ring == pytest.approx(one.memory_parts["transient"] / 4)


def test_a_rank_computes_one_cp_th_of_the_layer_plus_the_ring_steps(h100):
    seq = 32768
    h100 = dataclasses.replace(h100, gpu=dataclasses.replace(h100.gpu, sms=None))  # GEMM shapes apart (costs tests)
    for cp in (2, 8):
        fwd1, bwd1, _, ring1 = _layer_times(SPEC, 1, seq, 1, h100)
        fwd, bwd, _, _ = _layer_times(SPEC, 1, seq, 1, h100, cp=cp)
        merge_f, merge_b = context.merge_times(SPEC, 1, seq, 1, cp, h100)
        assert ring1 == (0.0, 0.0) and merge_f > 0 and merge_b > merge_f
        assert fwd - merge_f == pytest.approx(fwd1 / cp, rel=1e-9)  # matmuls compute-bound: all of it / cp
        assert bwd - merge_b == pytest.approx(bwd1 / cp, rel=1e-9)
    # attention is quadratic in the sequence, causal: half of 4·b·s²·heads·d
    att = costs.attention_time(1, seq, 16, 64, h100)
    assert att == pytest.approx(4 * seq ** 2 * 16 * 64 * 0.5 / (989e12 * 0.5))
    assert costs.attention_time(1, 2 * seq, 16, 64, h100) == pytest.approx(4 * att)


def test_ring_blocks_link_and_overlap(h100):
    # a block: 2·b·(s/cp)·(kv heads / tp, at least 1)·head_dim·bytes
    assert context.kv_block_bytes(SPEC, 2, 8192, 2, 4, 2) == 2 * 2 * 2048 * 2 * 64 * 2
    assert context.kv_block_bytes(SPEC, 1, 8192, 8, 4, 2) == 2 * 1 * 2048 * 1 * 64 * 2  # 4 kv heads, tp 8: 1
    assert context.ring_link(h100, 2, 4) is h100.intra_node and context.ring_link(h100, 8, 2) is h100.inter_node
    # on a fast link the transfers hide behind attention; on a slow one (cp-1)·(transfer - step's work)
    assert context.ring_times(SPEC, 1, 32768, 1, 4, 1e-3, 2.5e-3, h100) == (0.0, 0.0)
    slow = dataclasses.replace(h100, intra_node=dataclasses.replace(h100.intra_node, gbps=0.1))
    block = context.kv_block_bytes(SPEC, 1, 32768, 1, 4, 2)
    fwd, bwd = context.ring_times(SPEC, 1, 32768, 1, 4, 1e-3, 2.5e-3, slow)
    assert fwd == pytest.approx(3 * (costs.p2p_time(block, slow.intra_node) - 1e-3 / 4))
    assert bwd == pytest.approx(3 * (costs.p2p_time(2 * block, slow.intra_node) - 2.5e-3 / 4))
    work = Workload(gpus=4, seq=32768, global_batch_tokens=32768)
    est = estimate_plan(SPEC, slow, work, Plan(1, 1, 1, 0, 1, False, cp=4))
    assert est.cp_comm_s > 0 and est.comm_s >= est.cp_comm_s
    assert estimate_plan(SPEC, h100, work, Plan(1, 1, 1, 0, 1, False, cp=4)).cp_comm_s == 0.0


def test_gradients_are_reduced_and_sharded_over_dp_times_cp(h100):
    work = Workload(gpus=8, seq=16384, global_batch_tokens=4 * 16384)
    cp = estimate_plan(SPEC, h100, work, Plan(1, 1, 4, 1, 1, False, cp=2))
    dp = estimate_plan(SPEC, h100, dataclasses.replace(work, global_batch_tokens=8 * 16384), Plan(1, 1, 8, 1, 1, False))
    assert cp.memory_parts["optimizer"] == pytest.approx(dp.memory_parts["optimizer"])  # over 8 = dp·cp ranks
    p = SPEC.total_params
    assert cp.memory_parts["optimizer"] == pytest.approx(12 * p / 8)


def test_short_sequences_search_no_cp_and_long_ones_do(h100):
    short = Workload(gpus=16, seq=8192, global_batch_tokens=64 * 8192)
    assert {p.cp for p in candidates(SPEC, h100, short)} == {1}
    long = Workload(gpus=16, seq=65536, global_batch_tokens=8 * 65536)
    cps = {p.cp for p in candidates(SPEC, h100, long)}
    assert cps == {1, 2, 4, 8, 16}  # divisors of the GPUs tp leaves, each rank >= MIN_CP_TOKENS tokens
    assert context.cp_options(65536, 128) == [1, 2, 4, 8, 16, 32, 64]
    result = search(SPEC, h100, long)
    families = {(e.plan.tp, e.plan.cp, e.plan.pp, e.plan.ep) for e, _ in result.runners_up}
    assert len(families) == len(result.runners_up)


# -- Llama 3 405B, 131,072 tokens, 16,384 H100s (Dubey et al. 2024, Table 4: TP 8 CP 16 PP 16, 380 TFLOP/s) --
def test_llama3_405b_long_context_plan(llama405b, h100):
    work = Workload(gpus=16384, seq=131072, global_batch_tokens=16 * 2 ** 20)
    best = search(llama405b, h100, work).best
    p = best.plan
    assert best.fits and p.tp == 8 and p.cp > 1 and p.pp > 1  # tp inside the node, cp and pp across
    assert p.tp * p.cp > h100.gpus_per_node and p.tp * p.cp * p.pp * p.dp == 16384
    assert best.tflops_per_gpu > 300  # the plan without cp: 45 TFLOP/s (a 94 % bubble)
    no_cp = search(llama405b, h100, work, fixed={"cp": 1}).best
    assert no_cp.tflops_per_gpu < 50 and no_cp.bubble_s > 0.9 * no_cp.step_s
    published = search(llama405b, h100, work, fixed={"tp": 8, "cp": 16, "pp": 16}).best
    assert published.fits and 0.8 < published.tflops_per_gpu / 380 < 1.2


# -- the Trainer fragment and the command ----------------------------------------------------------
def test_fragment_maps_cp_with_tp_1_and_notes_tp(h100):
    work = Workload(gpus=16, seq=65536, global_batch_tokens=8 * 65536)
    data = result_json(search(SPEC, h100, work, fixed={"tp": 1, "cp": 4, "pp": 2, "virtual": 2}), SPEC, h100, work)
    t = data["trainer"]
    assert t["pas_policy"] == "cp" and data["cp"] == 4 and data["breakdown_s"]["cp_comm"] >= 0
    assert t["compute_config"]["plan_ngpus"] == 8 and t["compute_config"]["runtime_ngpus"] == 16
    assert t["compute_config"]["pas_config"] == {"pp_size": 2, "pipeline_pivots": "DecoderLayer",
                                                 "pipeline_nstages": 4, "pipeline_nmicros": data["nmicros"],
                                                 "pipeline_scheduler": "1f1b_interleaved",
                                                 **({"recompute_modules": "DecoderLayer"} if data["recompute"]
                                                    else {})}
    assert "trainer_note" not in data or "ZeRO" in data["trainer_note"]
    one = result_json(search(SPEC, h100, work, fixed={"tp": 1, "cp": 2, "pp": 1, "zero": 0}), SPEC, h100, work)
    cc = one["trainer"]["compute_config"]
    assert cc["plan_ngpus"] == 2 and cc["pas_config"] in ({}, {"recompute_modules": "DecoderLayer"})
    tp = result_json(search(SPEC, h100, work, fixed={"tp": 2, "cp": 4}), SPEC, h100, work)
    assert "does not map tensor parallelism with context parallelism" in tp["trainer_note"]
    assert tp["trainer"]["compute_config"]["plan_ngpus"] == 8 * tp["pp"]


def run(*args):
    return CliRunner().invoke(app, ["plan", "estimate", *map(str, args)],
                              env={"COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"})


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 4,
                                "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
                                "vocab_size": 256}))
    return path


def test_cli_forces_and_shows_cp(config):
    common = ["--model-config", config, "--cluster", "h100-sxm", "--gpus", 16, "--seq-len", 4096,
              "--global-batch-tokens", 16 * 4096]
    result = run(*common, "--cp", 4, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["cp"] == 4 and data["tp"] * data["cp"] * data["pp"] * data["dp"] == 16
    table = run(*common, "--cp", 4)
    assert table.exit_code == 0 and "cp 4," in table.output and "cp_comm" in table.output
    assert "┃ cp ┃" in table.output or " cp " in table.output


# -- errors -------------------------------------------------------------------------------------------
def test_a_cp_that_does_not_split_the_sequence_is_named(h100):
    work = Workload(gpus=24, seq=131072, global_batch_tokens=131072)
    with pytest.raises(ConfigError, match=r"--cp 3: the sequence \(131072 tokens\) must split into 2 x cp = 6 "
                                          r"equal chunks .*e\.g\. 2, 4, 8"):
        search(SPEC, h100, work, fixed={"cp": 3})
    with pytest.raises(ConfigError, match=r"Plan.cp 4: the sequence \(1004 tokens\) must split into 2 x cp = 8"):
        estimate_plan(SPEC, h100, Workload(4, 1004, 1004), Plan(1, 1, 1, 0, 1, False, cp=4))
    with pytest.raises(ConfigError, match="--cp must be a whole number >= 1, got 0"):
        search(SPEC, h100, work, fixed={"cp": 0})
    with pytest.raises(ConfigError, match="Plan.cp must be a whole number >= 1"):
        Plan(1, 1, 1, 0, 1, False, cp=0)


def test_cp_that_leaves_no_plan_and_cp_with_ep(h100):
    with pytest.raises(NoPlanFitsCluster, match="the context-parallel degree the GPUs tp leaves"):
        search(SPEC, h100, Workload(gpus=8, seq=65536, global_batch_tokens=65536), fixed={"cp": 16})
    moe = dataclasses.replace(SPEC, experts=8, top_k=2, expert_ffn=512)
    with pytest.raises(ConfigError, match=r"--cp 4 with --ep 2: .*experts are split over the cp ranks .*so ep is cp "
                                          r"or 1; use --ep 1 or 4"):
        search(moe, h100, Workload(gpus=8, seq=65536, global_batch_tokens=4 * 65536), fixed={"cp": 4, "ep": 2})
    with pytest.raises(ConfigError, match=r"Plan.ep \(4\) must be a whole number >= 1 dividing cp \(2\): with context"):
        Plan(1, 1, 4, 0, 1, False, cp=2, ep=4)


def test_cp_with_ep_is_planned(h100):
    """ep with cp > 1 is carved out of the cp ranks (the cp policy splits the experts over its unit): the
    search offers ep 1 and cp, the all-to-all runs over ep consecutive ranks of
    the cp group, the experts' memory is / ep and their gradients reduce over dp·cp / ep ranks."""
    moe = dataclasses.replace(SPEC, experts=8, top_k=2, expert_ffn=512, moe_layer_ids=None)
    work = Workload(gpus=8, seq=65536, global_batch_tokens=4 * 65536)
    assert {(p.cp, p.ep) for p in candidates(moe, h100, work) if p.tp == 1 and p.cp == 4} == {(4, 1), (4, 4)}
    forced = search(moe, h100, work, fixed={"cp": 4, "ep": 4, "tp": 1})
    assert (forced.best.plan.cp, forced.best.plan.ep) == (4, 4) and forced.best.ep_comm_s > 0
    plan = Plan(1, 1, 2, 1, 1, False, cp=4, ep=4)
    est, ep1 = estimate_plan(moe, h100, work, plan), estimate_plan(moe, h100, work, dataclasses.replace(plan, ep=1))
    routed = moe.moe_layers * moe.routed_layer_params
    assert ep1.memory_parts["weights"] - est.memory_parts["weights"] == pytest.approx(
        routed * 3 / 4 * 2, rel=0.05)  # bf16 experts: / 4 on each rank
    tokens = 65536 / 4  # a cp rank's tokens of one sequence; dispatch + combine over 4 intra-node ranks, fwd + bwd
    per_pass = 2 * costs.all_to_all_time(tokens * 2 * moe.hidden * 2, 4, h100.intra_node)
    assert est.ep_comm_s == pytest.approx(est.nmicros * moe.moe_layers * 2 * per_pass)
    t = trainer_fragment(est, moe, h100)
    assert t["pas_policy"] == "cp" and t["compute_config"]["pas_config"]["ep_size"] == 4
    assert sequences_per_step(t) == work.sequences


def test_cli_cp_errors_are_one_line(config):
    result = run("--model-config", config, "--cluster", "h100-sxm", "--gpus", 8, "--seq-len", 1004,
                 "--global-batch-tokens", 8032, "--cp", 4)
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "must split into 2 x cp = 8 equal chunks" in result.output.replace("\n", " ")
