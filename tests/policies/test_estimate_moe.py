"""Mixture-of-experts models in ``nnscaler plan estimate`` (nnscaler.policies.estimate): the MoE fields
of Mixtral, Qwen2/3-MoE, DeepSeek-V3 and gpt-oss configs, active against total parameters, the
expert-parallel degree (memory, all-to-all, the experts' gradient sync), the imbalance factor,
Mixtral-8x7B on 64 H100s, and the errors. Every config is written to a temp dir: nothing downloads."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from nnscaler.cli.main import app
from nnscaler.ir import ConfigError
from nnscaler.policies.estimate import (ModelConfigError, ModelSpec, Plan, Workload, costs, estimate_plan, load_cluster,
                                        result_json, search)
from nnscaler.policies.estimate.plan_cost import zero_sync_times
from nnscaler.policies.estimate.search import candidates

MIXTRAL_8X7B = {"model_type": "mixtral", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                "num_key_value_heads": 8, "intermediate_size": 14336, "num_local_experts": 8,
                "num_experts_per_tok": 2, "vocab_size": 32000}
SMALL = {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 96, "vocab_size": 128, "max_position_embeddings": 64}
# (config, routed experts, top-k, expert ffn, shared ffn, MoE layers)
SMALL_MOE = {
    "mixtral": (dict(SMALL, model_type="mixtral", num_local_experts=8, num_experts_per_tok=2),
                8, 2, 96, 0, (0, 1, 2, 3)),
    "qwen2_moe": (dict(SMALL, model_type="qwen2_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=48, decoder_sparse_step=2), 8, 2, 32, 48, (1, 3)),
    "qwen3_moe": (dict(SMALL, model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                       mlp_only_layers=[0]), 8, 2, 32, 0, (1, 2, 3)),
    "deepseek_v3": (dict(SMALL, model_type="deepseek_v3", n_routed_experts=8, n_shared_experts=2,
                         num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1, n_group=2,
                         topk_group=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                         v_head_dim=16), 8, 2, 32, 64, (1, 2, 3)),
    "gpt_oss": (dict(SMALL, model_type="gpt_oss", num_local_experts=8, num_experts_per_tok=2, head_dim=16),
                8, 2, 96, 0, (0, 1, 2, 3)),
}


def write(tmp_path, data, name="config.json"):
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    return ModelSpec.from_hf_config(write(tmp_path_factory.mktemp("mixtral"), MIXTRAL_8X7B))


@pytest.fixture(scope="module")
def h100():
    return load_cluster("h100-sxm")


# -- the model ----------------------------------------------------------------------------------
def test_mixtral_8x7b_active_and_total(mixtral):
    assert (mixtral.experts, mixtral.top_k, mixtral.expert_ffn, mixtral.shared_ffn, mixtral.moe_layers) == \
        (8, 2, 14336, 0, 32)
    assert mixtral.total_params == 46_702_792_704  # counted on the meta model
    routed = 32 * 8 * 3 * 4096 * 14336
    assert mixtral.routed_params == routed
    assert mixtral.active_params == mixtral.total_params - routed * 6 // 8
    assert 12.8e9 < mixtral.active_params < 13.0e9 and mixtral.layer_class == "MixtralDecoderLayer"


@pytest.mark.parametrize("kind", sorted(SMALL_MOE))
def test_moe_fields_of_each_config_family(tmp_path, kind):
    raw, experts, top_k, expert_ffn, shared, moe_ids = SMALL_MOE[kind]
    spec = ModelSpec.from_hf_config(write(tmp_path, raw))
    assert (spec.experts, spec.top_k, spec.expert_ffn, spec.shared_ffn, spec.moe_layer_ids) == \
        (experts, top_k, expert_ffn, shared, moe_ids)
    assert ModelSpec.from_hf_config(write(tmp_path, raw), meta=False).moe_layer_ids == moe_ids  # config alone agrees
    assert spec.active_params == round(spec.total_params - spec.routed_params * (experts - top_k) / experts)
    if kind != "gpt_oss":  # gpt-oss's experts have biases: counted on the meta model, not in the analytic count
        assert spec.routed_params == len(moe_ids) * experts * 3 * 64 * expert_ffn


def test_a_dense_config_stays_dense(tmp_path):
    spec = ModelSpec.from_hf_config(write(tmp_path, dict(SMALL, model_type="llama")))
    assert not spec.is_moe and spec.moe_layer_ids == () and spec.active_params == spec.total_params


@pytest.mark.parametrize("change, words", [
    ({"num_experts_per_tok": 10}, ["'num_experts_per_tok' (10) exceeds the 8 routed experts ('num_local_experts')",
                                   "set 'num_experts_per_tok' to at most 8"]),
    ({"num_experts_per_tok": 0}, ["'num_experts_per_tok' must be a whole number >= 1", "set it in the config"]),
])
def test_bad_moe_configs_name_the_field_and_fix(tmp_path, change, words):
    with pytest.raises(ModelConfigError) as e:
        ModelSpec.from_hf_config(write(tmp_path, dict(SMALL_MOE["mixtral"][0], **change)))
    for w in words:
        assert w in str(e.value)
    assert "config.json" in str(e.value)


# -- the cost model ------------------------------------------------------------------------------
SPEC = ModelSpec(hidden=1024, layers=4, heads=16, kv_heads=16, head_dim=64, ffn=4096, vocab=32000, experts=8,
                 top_k=2, expert_ffn=2048)
WORK = Workload(gpus=8, seq=1024, global_batch_tokens=8 * 1024)


def test_expert_memory_is_divided_by_ep_and_sharded_over_dp_over_ep(h100):
    est = estimate_plan(SPEC, h100, WORK, Plan(1, 1, 8, 1, 1, False, ep=4))
    scale = SPEC.total_params / (SPEC.layers_params + 2 * SPEC.embedding_params)
    shared = (4 * SPEC.moe_layer_params + 2 * SPEC.embedding_params) * scale
    experts = 4 * SPEC.routed_layer_params / 4 * scale
    assert est.memory_parts["weights"] == pytest.approx(2 * (shared + experts))
    assert est.memory_parts["optimizer"] == pytest.approx(12 * shared / 8 + 12 * experts / 2)  # zero over dp, dp/ep
    ep1 = estimate_plan(SPEC, h100, WORK, Plan(1, 1, 8, 1, 1, False))
    assert ep1.memory_parts["weights"] == pytest.approx(2 * (shared + 4 * experts))


def test_all_to_all_volume_and_link(h100):
    s, k, h = 1024, 2, 1024
    nbytes = {tp: s / tp * k * h * 2 for tp in (1, 2)}  # dispatch or combine: a rank's b·s/tp tokens, k copies
    across = 2 * costs.split_all_to_all_time(nbytes[2], 8, 4, h100.intra_node, h100.inter_node)
    for tp, ep, gpus, per_pass in ((1, 8, 8, 2 * costs.all_to_all_time(nbytes[1], 8, h100.intra_node)),
                                   (2, 4, 8, 2 * costs.all_to_all_time(nbytes[2], 4, h100.intra_node)),
                                   (2, 8, 16, across)):  # 8 ranks over 2 nodes
        work = Workload(gpus=gpus, seq=s, global_batch_tokens=gpus // tp * s)  # one sequence a dp rank
        est = estimate_plan(SPEC, h100, work, Plan(tp, 1, gpus // tp, 0, 1, False, ep=ep))
        assert est.ep_comm_s == pytest.approx(4 * 2 * per_pass)  # 4 MoE layers, forward + backward
    assert estimate_plan(SPEC, h100, WORK, Plan(1, 1, 8, 0, 1, False)).ep_comm_s == 0.0
    assert costs.all_to_all_time(8e6, 8, h100.intra_node) == pytest.approx(7 / 8 * 8e6 / 450e9 + 7 * 3e-6)
    # across nodes: half of the 8 ranks in each node, so 4/8 of the bytes leave on the NIC (50 GB/s) while
    # 3/8 go over NVLink (450 GB/s); 7 latencies of the inter-node link
    assert costs.split_all_to_all_time(8e6, 8, 4, h100.intra_node, h100.inter_node) == \
        pytest.approx(4 / 8 * 8e6 / 50e9 + 7 * 10e-6)
    # DeepSeek-V3's EP64 over 8 nodes: 56/64 of the bytes cross nodes (the flat model sent 63/64 over IB)
    assert costs.split_all_to_all_time(64e6, 64, 8, h100.intra_node, h100.inter_node) == \
        pytest.approx(56 / 64 * 64e6 / 50e9 + 63 * 10e-6)
    slow_nvlink = dataclasses.replace(h100.intra_node, gbps=1)  # the intra-node share can be the slower one
    assert costs.split_all_to_all_time(8e6, 8, 4, slow_nvlink, h100.inter_node) == \
        pytest.approx(3 / 8 * 8e6 / 1e9 + 7 * 10e-6)


def test_expert_gradients_reduce_over_dp_over_ep(h100):
    plan = Plan(1, 1, 8, 0, 1, False, ep=4)
    experts = dataclasses.replace(plan, dp=2, ep=1)
    assert zero_sync_times(1e9, experts, 1, h100, stride=4)[0] == \
        pytest.approx(costs.ring_all_reduce_time(1e9, 2, h100.intra_node))
    est, ep1 = (estimate_plan(SPEC, h100, WORK, p) for p in (plan, dataclasses.replace(plan, ep=1)))
    assert est.dp_comm_s < ep1.dp_comm_s


def test_imbalance_and_active_flops(h100):
    plan = Plan(1, 1, 8, 0, 1, False, ep=8)
    even = estimate_plan(SPEC, h100, dataclasses.replace(WORK, moe_imbalance=1.0), plan)
    skewed = estimate_plan(SPEC, h100, dataclasses.replace(WORK, moe_imbalance=1.5), plan)
    assert skewed.compute_s > even.compute_s and skewed.ep_comm_s == even.ep_comm_s
    assert even.model_flops == skewed.model_flops == pytest.approx(costs.model_flops(
        SPEC.active_params, WORK.global_batch_tokens, 4, 16, 64, 1024))
    assert SPEC.active_params < SPEC.total_params


def test_plans_refused(h100):
    with pytest.raises(ConfigError, match=r"Plan.ep \(3\) must be a whole number >= 1 dividing dp \(8\)"):
        Plan(1, 1, 8, 0, 1, False, ep=3)
    with pytest.raises(ConfigError, match=r"Plan.ep \(4\) must divide the model's routed experts \(6\)"):
        estimate_plan(dataclasses.replace(SPEC, experts=6), h100, WORK, Plan(1, 1, 8, 0, 1, False, ep=4))
    with pytest.raises(ConfigError, match="--moe-imbalance must be a number >= 1"):
        search(SPEC, h100, dataclasses.replace(WORK, moe_imbalance=0.5))


# -- Mixtral-8x7B on 64 H100s ----------------------------------------------------------------------
def test_mixtral_8x7b_on_64_h100(mixtral, h100):
    work = Workload(gpus=64, seq=4096, global_batch_tokens=1024 * 4096)
    assert {p.ep for p in candidates(mixtral, h100, work)} == {1, 2, 4, 8}
    result = search(mixtral, h100, work, top=20)
    best = result.best
    assert best.fits and best.memory_gb <= 80 * costs.USABLE_MEMORY
    assert best.plan.tp * best.plan.pp * best.plan.dp == 64 and best.plan.dp % best.plan.ep == 0
    assert {e.plan.ep for e, _ in result.runners_up} | {best.plan.ep} > {1}  # ep > 1 priced and listed
    data = result_json(result, mixtral, h100, work)
    assert data["ep"] == best.plan.ep and all("ep" in r for r in data["runners_up"])
    assert data["moe"]["active_params"] == mixtral.active_params and data["moe"]["imbalance"] == 1.1
    assert 0 < data["mfu"] < 1 and "ep_comm" in data["breakdown_s"]


# -- the command -----------------------------------------------------------------------------------
def run(config, *extra, gpus=64, tokens=1024 * 4096):
    return CliRunner().invoke(app, ["plan", "estimate", "--model-config", str(config), "--cluster", "h100-sxm",
                                    "--gpus", str(gpus), "--seq-len", "4096", "--global-batch-tokens", str(tokens),
                                    *map(str, extra)], env={"COLUMNS": "220", "NO_COLOR": "1", "TERM": "dumb"})


def test_command_reports_ep_active_params_and_imbalance(tmp_path):
    config = write(tmp_path, MIXTRAL_8X7B)
    out = run(config, "--moe-imbalance", "1.25")
    assert out.exit_code == 0, out.output
    text = out.output
    assert "(46.7 B parameters, 12.9 B active)" in text and "12.9 B of 46.7 B parameters active" in text
    assert "expert load imbalance 1.25 assumed" in text
    plan_line = next(line for line in text.splitlines() if line.strip().startswith("plan:"))
    header = next(line for line in text.splitlines() if "lost on" in line)
    assert ", ep " in plan_line and " ep " in header
    forced = json.loads(run(config, "--ep", "2", "--json").output)
    assert forced["ep"] == 2 and all(r["ep"] == 2 for r in forced["runners_up"])


@pytest.mark.parametrize("args, model, words", [
    (("--ep", "3"), MIXTRAL_8X7B, ["--ep 3 must divide the model's 8 routed experts", "use one of 1, 2, 4, 8"]),
    (("--ep", "2"), dict(SMALL, model_type="llama"), ["--ep 2 needs a mixture-of-experts model", "drop --ep"]),
    (("--moe-imbalance", "0.9"), MIXTRAL_8X7B, ["--moe-imbalance must be a number >= 1"]),
    ((), dict(MIXTRAL_8X7B, num_experts_per_tok=9), ["'num_experts_per_tok' (9) exceeds the 8 routed experts"]),
])
def test_command_errors_are_one_line(tmp_path, args, model, words):
    out = run(write(tmp_path, model), *args)
    assert out.exit_code == 1 and "Traceback" not in out.output
    for w in words:
        assert w in out.output.replace("\n", " ")


def test_trainer_fragment_runs_expert_parallelism_with_the_ep_policy(mixtral, h100):
    """ep > 1 with tp 1 maps onto pas_policy ep (plan = pp x ep, units of dp / ep); with tp > 1 it does not."""
    from nnscaler.policies.estimate.report import trainer_fragment
    work = Workload(gpus=64, seq=4096, global_batch_tokens=1024 * 4096)
    plan = Plan(tp=1, pp=2, dp=32, ep=8, zero=1, micro_batch=1, recompute=False, virtual=2)
    t = trainer_fragment(estimate_plan(mixtral, h100, work, plan), mixtral, h100)
    c = t["compute_config"]
    assert t["pas_policy"] == "ep" and (c["plan_ngpus"], c["runtime_ngpus"]) == (16, 64)
    assert (c["pas_config"]["pp_size"], c["pas_config"]["pipeline_nstages"]) == (2, 4)
    assert c["pas_config"]["pipeline_scheduler"] == "1f1b_interleaved"
    with_tp = dataclasses.replace(plan, tp=2, dp=16, virtual=1)
    assert trainer_fragment(estimate_plan(mixtral, h100, work, with_tp), mixtral, h100)["pas_policy"] != "ep"


def test_the_fragment_runs_the_planned_tokens_through_the_trainers_check(mixtral, h100):
    """Mixtral-8x7B on 64 H100 (tp 1, pp 2, dp 32, ep 8): the fragment's config, checked by the Trainer
    (TrainerArgs.validate, on the example hf_moe.yaml with the fragment's fields), takes the plan's 1,024
    sequences a step: 4 units of ep 8 x pp 2, each micro-batch 8 sequences (1 per ep rank) x 32."""
    import yaml
    from nnscaler.policies.estimate.report import sequences_per_step, trainer_fragment
    from nnscaler.trainer import TrainerArgs
    work = Workload(gpus=64, seq=4096, global_batch_tokens=1024 * 4096)
    plan = Plan(tp=1, pp=2, dp=32, ep=8, zero=1, micro_batch=1, recompute=False, virtual=1)
    est = estimate_plan(mixtral, h100, work, plan)
    t = trainer_fragment(est, mixtral, h100)
    assert (t["micro_batch_size"], t["grad_accumulation_steps"], sequences_per_step(t)) == (8, 32, 1024)
    with open(Path(__file__).parents[2] / "examples" / "trainer" / "hf_moe.yaml") as f:
        data = yaml.safe_load(f)
    data.pop("global_batch_size")
    data["model"]["args"]["config"]["num_local_experts"] = 8
    data.update(t)
    args = TrainerArgs.from_dict(data)  # validates: the policy, its pas_config keys, the batches
    assert args.dp_size == 4 and args.resolved_global_batch_size * work.seq == work.global_batch_tokens
    assert est.nmicros * plan.dp * plan.micro_batch * work.seq == work.global_batch_tokens
