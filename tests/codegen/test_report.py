"""The plan report codegen builds: exact parameter counts and bytes of known plans, the collectives
per step against what a real 2-process run measures, un-annotated ops, pipelines."""
from __future__ import annotations

import ast
import fnmatch
import json
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from launch import run_workers  # noqa: E402

from cp_models import AttentionMoE  # noqa: E402
from gpt import GPT, GPTConfig, random_batch  # noqa: E402
from nnscaler.codegen import REPORT_JSON, REPORT_TEXT, build_report, generate  # noqa: E402
from nnscaler.ir import ComputeConfig, trace  # noqa: E402
from nnscaler.ir.contracts import PlanReport  # noqa: E402
from nnscaler.policies import apply_policy  # noqa: E402

CFG = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)
BATCH = 4
# the Megatron policy's defaults on the example GPT: column-parallel q/k/v and c_fc (weight and
# bias split), row-parallel c_proj (weight split, bias whole)
MEGATRON_SHARDED = ("*.q_proj.*", "*.k_proj.*", "*.v_proj.*", "*.c_fc.*", "*.c_proj.weight")


def _planned(policy, plan, world, **cfg):
    torch.manual_seed(0)
    model = GPT(CFG)
    graph = trace(model, random_batch(0, BATCH * plan // world, CFG))
    cc = ComputeConfig(plan, world, **cfg)
    return model, apply_policy(graph, cc, policy), cc


def _registered(text: str):
    """full name -> (full shape, local shape) of every parameter rank code registers (add_full_map)."""
    out = {}
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_full_map":
            full = ast.literal_eval(node.args[1])
            kw = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
            out[full] = (tuple(kw["full_shape"]), tuple(b - a for a, b in kw["slices"]))
    return out


def _nbytes(shape, itemsize=4):
    return math.prod(shape) * itemsize


def test_megatron_report_has_exact_counts_and_bytes(tmp_path):
    model, graph, cc = _planned("megatron", 2, 2)
    report = build_report(graph, cc, "megatron")
    params = dict(model.named_parameters())  # tied lm_head.weight is wte.weight: counted once
    sharded = {n for n in params if any(fnmatch.fnmatchcase(n, g) for g in MEGATRON_SHARDED)}
    assert len(sharded) == 10 * CFG.n_layer
    assert report.params_sharded == len(sharded)
    assert report.params_replicated == len(params) - len(sharded)
    assert report.bytes_sharded == sum(params[n].numel() * 4 for n in sharded)
    assert report.bytes_replicated == sum(p.numel() * 4 for n, p in params.items() if n not in sharded)
    assert report.bytes_per_device == [report.bytes_sharded // 2 + report.bytes_replicated] * 2
    by_path = {m.path: m for m in report.modules}
    assert [(o.op, o.dim) for o in by_path["h.1.attn.q_proj"].ops] == [("linear", "n")]
    assert [(o.op, o.dim) for o in by_path["h.0.mlp.c_proj"].ops] == [("linear", "k")]
    assert [(o.op, o.dim) for o in by_path["ln_f"].ops] == [("layer_norm", None)]
    # per block: one all-reduce after attention, one after the MLP, and their duals in backward
    act = BATCH * CFG.block_size * CFG.n_embd * 4
    assert report.collectives("forward") == {"all_reduce": (2 * CFG.n_layer, 2 * CFG.n_layer * act)}
    assert report.collectives("backward") == {"all_reduce": (2 * CFG.n_layer, 2 * CFG.n_layer * act)}
    assert report.warnings() == []
    text = report.render_text()
    assert "h.0..h.1 (x2, each)" in text and "linear[n]" in text and "linear[k]" in text


@pytest.mark.parametrize("policy,plan,world", [("megatron", 2, 2), ("tp", 2, 2), ("tp", 2, 4), ("dp", 1, 2)])
def test_storage_in_report_is_what_the_generated_code_registers(tmp_path, policy, plan, world):
    _, graph, cc = _planned(policy, plan, world)
    generate(graph, cc, tmp_path, policy=policy)
    report = PlanReport.from_json(json.loads((tmp_path / REPORT_JSON).read_text()))
    assert (tmp_path / REPORT_TEXT).read_text() == report.render_text()
    registered = _registered((tmp_path / "gencode0.py").read_text())
    params = {n: registered[n] for n in graph.params}
    split = {n for n, (full, local) in params.items() if full != local}
    assert report.params_sharded == (len(split) if plan > 1 else 0)
    assert report.params_replicated == len(params) - report.params_sharded
    assert report.bytes_sharded == (sum(_nbytes(params[n][0]) for n in split) if plan > 1 else 0)
    assert report.bytes_per_device[0] == sum(_nbytes(local) for _, local in params.values())
    assert report.dp_size == world // plan
    assert (report.dp_grad_bytes > 0) == (world // plan > 1)
    if policy == "dp":
        assert report.total_calls() == 0 and report.warnings() == []


class Bilinear(nn.Module):
    """Its parameters are read only by F.bilinear, which has no dimension annotation."""

    def __init__(self, dim: int = 8):
        super().__init__()
        self.b1 = nn.Bilinear(dim, dim, dim)
        self.b2 = nn.Bilinear(dim, dim, dim)

    def forward(self, x, y):
        h = torch.tanh(self.b1(x, x))
        h = self.b2(h, h)
        return F.mse_loss(h.sum(-1), y)


def test_unannotated_ops_are_listed_with_the_user_line_and_the_plan_warns():
    graph = trace(Bilinear(), {"x": torch.randn(4, 8), "y": torch.randn(4)})
    cc = ComputeConfig(2, 2)
    report = build_report(apply_policy(graph, cc, "tp"), cc, "tp")
    # one entry per (op, user line): the user's lines, not torch's nn.Bilinear.forward
    assert [(u.target, u.module, u.count) for u in report.unannotated] == [
        ("torch.nn.functional.bilinear", "b1", 1), ("torch.nn.functional.bilinear", "b2", 1)]
    assert report.unannotated[0].where.startswith("test_report.py:")
    assert report.unannotated[0].where.endswith("h = torch.tanh(self.b1(x, x))")
    assert report.params_sharded == 0 and report.bytes_replicated == sum(
        p.numel() * 4 for p in Bilinear().parameters())
    (message,) = report.warnings()
    assert "shards no parameter but sends" in message and "torch.nn.functional.bilinear x1 at" in message
    assert "register_op(torch.nn.functional.bilinear" in message


def test_pipeline_report_names_the_stages():
    _, graph, cc = _planned("pp", 2, 2, use_end2end=True, pas_config={"pipeline_nmicros": 4})
    report = build_report(graph, cc, "pp")
    assert report.pipeline["nstages"] == 2 and report.pipeline["nmicros"] == 4
    stages = report.pipeline["stages"]
    assert "wte" in stages[0] and "lm_head" in stages[max(stages)]
    # each stage's tensors live on its pipeline device only: nothing is held twice but the tied wte
    params = dict(GPT(CFG).named_parameters())
    assert sum(report.bytes_per_device) == sum(p.numel() * 4 for p in params.values()) + params["wte.weight"].numel() * 4
    assert report.warnings() == []  # tp_size 1: stages split the model, not tensor parallelism
    assert "stage 0:" in report.render_text()


# -- analytic vs measured ------------------------------------------------------------------------------

CASES = [("megatron", 2, {}), ("tp", 2, {}), ("dp", 1, {}), ("megatron", 2, {"recompute_modules": "Block"})]


def _measure(rank, world, gen_dir):
    from nnscaler import parallelize
    from nnscaler.runtime.comm import count_collectives, enable_stats
    from nnscaler.runtime.driver.plan_report import load_plan_report
    out = []
    enable_stats()
    for i, (policy, plan, pas) in enumerate(CASES):
        torch.manual_seed(0)
        batch = random_batch(0, BATCH * plan // world, CFG)
        cc = ComputeConfig(plan, world, trace_strategy="cpu", pas_config=pas)
        pm = parallelize(GPT(CFG), batch, policy, cc, gen_savedir=gen_dir, instance_name=f"case{i}")
        with count_collectives() as fwd:
            loss = pm(**batch)
        with count_collectives() as bwd:
            loss.backward()
        report = load_plan_report(Path(gen_dir) / f"{GPT.__module__}.GPT" / f"case{i}") if rank == 0 else None
        out.append((fwd.snapshot(), bwd.snapshot(), report and report.to_json()))
    return out


@pytest.mark.multiprocess
@pytest.mark.slow
def test_collectives_per_step_equal_what_a_real_run_measures(tmp_path):
    results = run_workers(_measure, 2, str(tmp_path), timeout=300)
    for (policy, plan, pas), (fwd, bwd, data), (fwd1, bwd1, _) in zip(CASES[:-1], results[0], results[1]):
        report = PlanReport.from_json(data)
        label = (policy, plan, pas)
        measured_fwd = {k: (v["calls"], v["bytes"]) for k, v in fwd.items()}
        measured_bwd = {k: (v["calls"], v["bytes"]) for k, v in bwd.items() if k != "dp_all_reduce"}
        assert report.collectives("forward") == measured_fwd, label
        assert report.collectives("backward") == measured_bwd, label
        assert (fwd, bwd) == (fwd1, bwd1), label  # every rank of the unit runs the same collectives
        if report.dp_size > 1:
            assert bwd["dp_all_reduce"]["bytes"] == report.dp_grad_bytes, label
        else:
            assert "dp_all_reduce" not in bwd, label
        assert report.recompute == [], label

    # activation checkpointing: the duals as above, plus at most the segments' forward collectives
    (fwd, bwd, data) = results[0][-1]
    report = PlanReport.from_json(data)
    assert report.collectives("forward") == {k: (v["calls"], v["bytes"]) for k, v in fwd.items()}
    duals, rerun = report.collectives("backward"), report.collectives("recompute")
    assert rerun == report.collectives("forward")  # every forward collective sits in a Block
    measured = bwd["all_reduce"]
    assert duals["all_reduce"][0] < measured["calls"] <= duals["all_reduce"][0] + rerun["all_reduce"][0]
    assert duals["all_reduce"][1] < measured["bytes"] <= duals["all_reduce"][1] + rerun["all_reduce"][1]


# -- context and expert parallelism: the runtime's own exchanges ---------------------------------------

def _cp_moe_batch():
    ids = torch.randint(0, 16, (2, 8), generator=torch.Generator().manual_seed(0))
    return {"ids": ids, "labels": ids.roll(1, 1)}


def test_cp_report_names_ring_attention_and_the_experts_exchanges():
    torch.manual_seed(0)
    graph = apply_policy(trace(AttentionMoE(), _cp_moe_batch()), ComputeConfig(2, 2), "cp")
    report = build_report(graph, ComputeConfig(2, 2), "cp")
    assert report.runtime_ops == {"expert_parallel": 1, "ring_attention": 1, "sequence_loss": 1}
    fwd, bwd = report.collectives("forward"), report.collectives("backward")
    # the ring: 1 step of a K and a V block (batch 2 x 2 heads x 4 rows x 4 x 4 bytes) forward; backward with dK, dV
    # and the gradients sent home
    assert fwd["ring_send"] == (2, 2 * 256) and bwd["ring_send"] == (6, 6 * 256)
    assert fwd["all_to_all"][0] >= 6 and bwd["all_to_all"][0] >= 7  # 4 zigzag + 2 expert exchanges; 5 + 2
    text = report.render_text()
    assert "context parallel: ring attention over 2 ranks (x1 a step)" in text
    assert "expert parallel: experts split over 2 ranks, tokens exchanged (x1 a step)" in text
    assert "ring_send x2" in text


def test_ep_size_report_adds_the_experts_gather():
    """cp 4 with ep_size 2: beside the exchanges, one all-gather of the rank's stored experts (1/4 of up and
    down) forward and one reduce-scatter of its group position's half backward; nothing else changes."""
    torch.manual_seed(0)
    model, batch = AttentionMoE(), {"ids": torch.randint(0, 16, (4, 8)), "labels": torch.randint(0, 16, (4, 8))}
    stored = (model.up.numel() + model.down.numel()) * 4 // 4  # float32 bytes, 1/4 on each rank
    reports = {}
    for ep in (None, 2):
        cfg = ComputeConfig(4, 4, pas_config={} if ep is None else {"ep_size": ep})
        reports[ep] = build_report(apply_policy(trace(AttentionMoE(), batch), cfg, "cp"), cfg, "cp")
    for which, kind, nbytes in (("forward", "all_gather", stored), ("backward", "reduce_scatter", stored * 2)):
        full, grouped = reports[None].collectives(which), reports[2].collectives(which)
        calls, total = full.get(kind, (0, 0))
        assert grouped[kind] == (calls + 1, total + nbytes), (which, full, grouped)
        assert {k: v for k, v in grouped.items() if k != kind} == {k: v for k, v in full.items() if k != kind}


def _measure_cp(rank, world, gen_dir):
    from nnscaler import parallelize
    from nnscaler.runtime.comm import count_collectives
    from nnscaler.runtime.driver.plan_report import load_plan_report
    torch.manual_seed(0)
    pm = parallelize(AttentionMoE(), _cp_moe_batch(), "cp", ComputeConfig(2, 2, trace_strategy="cpu"),
                     gen_savedir=gen_dir, instance_name="cp_moe")
    with count_collectives() as fwd:
        loss = pm(**_cp_moe_batch())
    with count_collectives() as bwd:
        loss.backward()
    report = load_plan_report(Path(gen_dir) / f"{AttentionMoE.__module__}.AttentionMoE" / "cp_moe")
    return fwd.snapshot(), bwd.snapshot(), report.to_json()


@pytest.mark.multiprocess
@pytest.mark.slow
def test_cp_collectives_equal_what_a_real_run_measures(tmp_path):
    """cp on attention + experts: the report's collectives (the adapters', ring attention's all-to-alls, the
    experts' dispatch and combine) are those the run counts; ring_send (isend, not counted) apart."""
    results = run_workers(_measure_cp, 2, str(tmp_path), timeout=300)
    report = PlanReport.from_json(results[0][2])
    assert report.runtime_ops == {"expert_parallel": 1, "ring_attention": 1, "sequence_loss": 1}
    for i, which in enumerate(("forward", "backward")):
        expected = {k: v for k, v in report.collectives(which).items() if k != "ring_send"}
        got = [{k.replace("(fallback)", ""): (v["calls"], v["bytes"]) for k, v in r[i].items()} for r in results]
        assert all(g.keys() == expected.keys() for g in got), (which, expected, got)
        for kind, (calls, nbytes) in expected.items():
            assert all(g[kind][0] == calls for g in got), (which, kind, expected, got)
            # the experts' combine sends what routing gave each rank: exact summed over the unit
            assert sum(g[kind][1] for g in got) == 2 * nbytes, (which, kind, expected, got)
