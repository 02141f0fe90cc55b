"""What a cluster's software achieves (nnscaler.policies.estimate): ``fused_attention: false`` (the
scores materialised: their time and memory), calibration from one measured step
(``--calibrate-step-seconds``, `calibrate`), ``--fix``, the defaults unchanged, and each error."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from nnscaler.cli.main import app
from nnscaler.ir import ConfigError
from nnscaler.policies.estimate import (ClusterError, ModelSpec, Plan, Workload, calibrate, costs, estimate_plan,
                                        load_cluster, parse_cluster, search)
from nnscaler.policies.estimate.calibrate import scaled
from nnscaler.policies.estimate.cli import parse_fix

SPEC = ModelSpec(hidden=1024, layers=4, heads=16, kv_heads=16, head_dim=64, ffn=4096, vocab=32000)
H100 = {"gpu": {"name": "H100-SXM-80GB"}, "gpus_per_node": 8, "intra_node": {"gbps": 450, "latency_us": 3},
        "inter_node": {"gbps": 50, "latency_us": 10}}


@pytest.fixture(scope="module")
def a100():
    return load_cluster("a100-80gb-sxm")


def test_fused_attention_is_read_and_defaults_to_true(tmp_path):
    assert load_cluster("h100-sxm").fused_attention is True
    c = parse_cluster(dict(H100, fused_attention=False), "mine.yaml")
    assert c.fused_attention is False and c.to_json()["fused_attention"] is False
    with pytest.raises(ClusterError, match=r"mine.yaml: 'fused_attention' must be true or false .* got 'no'"):
        parse_cluster(dict(H100, fused_attention="no"), "mine.yaml")


def test_defaults_are_unchanged(a100):
    """An explicit `fused_attention: true` prices exactly as the shipped description."""
    work = Workload(gpus=8, seq=2048, global_batch_tokens=64 * 2048)
    explicit = parse_cluster(dict(yaml.safe_load(Path(a100.source).read_text()), fused_attention=True), a100.source)
    for plan in (Plan(8, 1, 1, 0, 1, False), Plan(2, 2, 2, 1, 2, True)):
        assert estimate_plan(SPEC, explicit, work, plan) == estimate_plan(SPEC, a100, work, plan)


def test_unfused_attention_time_and_memory(a100):
    unfused = dataclasses.replace(a100, fused_attention=False)
    b, s, heads, d = 2, 2048, 8, 64
    flops = 4 * b * s * s * heads * d  # the causal mask skips nothing
    scores = b * heads * s * s * 2
    expect = flops / (312e12 * 0.8) + 6 * scores / (2039e9 * 0.8)
    assert costs.unfused_attention_time(b, s, heads, d, unfused) == pytest.approx(expect)
    work = Workload(gpus=1, seq=s, global_batch_tokens=s)
    fused_e = estimate_plan(SPEC, a100, work, Plan(1, 1, 1, 0, 1, False))
    unfused_e = estimate_plan(SPEC, unfused, work, Plan(1, 1, 1, 0, 1, False))
    kept = 5 * 16 * s * s  # softmax output, dropout mask and output: 5 bytes a score (Korthikanti et al.)
    assert unfused_e.memory_parts["activations"] - fused_e.memory_parts["activations"] == pytest.approx(4 * kept)
    assert unfused_e.step_s > fused_e.step_s


def test_calibration_reproduces_a_measured_step(a100):
    work = Workload(gpus=16, seq=2048, global_batch_tokens=256 * 2048)
    best = search(SPEC, a100, work).best
    for slower in (1.0, 1.5):
        cal = calibrate(SPEC, a100, work, best.plan, best.step_s * slower)
        assert cal["estimated_step_s"] == pytest.approx(best.step_s)
        fitted = estimate_plan(SPEC, scaled(a100, cal["factor"]), work, best.plan)
        assert fitted.step_s == pytest.approx(best.step_s * slower, rel=1e-6)
        if slower == 1.0:
            assert cal["factor"] == pytest.approx(1.0, rel=1e-6)
        # the printed YAML is a cluster description's `efficiency`, and prices the step as measured
        eff = yaml.safe_load(cal["yaml"])["efficiency"]
        assert eff == cal["efficiency"] and eff["matmul"] == pytest.approx(0.8 * cal["factor"], abs=1e-4)
        from_yaml = parse_cluster(dict(yaml.safe_load(Path(a100.source).read_text()), efficiency=eff), "calibrated.yaml")
        assert estimate_plan(SPEC, from_yaml, work, best.plan).step_s == pytest.approx(best.step_s * slower, rel=1e-3)


def test_calibration_on_one_2021_run_predicts_the_others():
    """Megatron-LM 2021 (Narayanan et al., Table 1; no fused attention, full recomputation, A100s):
    calibrated on the 1T run's step, the 530B and 145.6B runs come out within 10 % of their MFU."""
    cluster = dataclasses.replace(load_cluster("a100-80gb-sxm"), fused_attention=False)

    def gpt(h, layers, heads):
        return ModelSpec(hidden=h, layers=layers, heads=heads, kv_heads=heads, head_dim=h // heads, ffn=4 * h,
                         vocab=51200, gated=False, tied=True)

    def run(spec, gpus, seqs, pp, c):
        work = Workload(gpus, 2048, seqs * 2048)
        return work, search(spec, c, work, fixed={"tp": 8, "pp": pp, "recompute": True, "zero": 0}).best

    one_t = gpt(25600, 128, 160)
    work, est = run(one_t, 3072, 3072, 64, cluster)
    measured = est.model_flops / (0.39 * 3072 * 312e12)  # 39 % MFU (163 TFLOP/s with recomputation counted)
    cal = calibrate(one_t, cluster, work, est.plan, measured)
    assert 0.6 < cal["factor"] < 1.0
    fitted = scaled(cluster, cal["factor"])
    for spec, gpus, seqs, pp, mfu in ((gpt(20480, 105, 128), 2520, 2520, 35, 0.39),
                                      (gpt(12288, 80, 96), 1536, 2304, 8, 0.3525)):
        assert 0.9 < run(spec, gpus, seqs, pp, fitted)[1].mfu / mfu < 1.1


def test_calibration_errors(a100):
    work = Workload(gpus=8, seq=2048, global_batch_tokens=64 * 2048)
    plan = Plan(8, 1, 1, 0, 1, False)
    step = estimate_plan(SPEC, a100, work, plan).step_s
    with pytest.raises(ConfigError, match="--calibrate-step-seconds .*: faster than tp8 pp1 dp1 mb1 can run"):
        calibrate(SPEC, a100, work, plan, step / 10)
    with pytest.raises(ConfigError, match="--calibrate-step-seconds .*: slower than tp8 pp1 dp1 mb1 at 0.001 x"):
        calibrate(SPEC, a100, work, plan, step * 1e5)
    for bad in (0, -1.0, float("nan"), True):
        with pytest.raises(ConfigError, match="--calibrate-step-seconds must be a number of seconds > 0"):
            calibrate(SPEC, a100, work, plan, bad)


def test_fix_is_parsed_and_each_bad_item_named():
    assert parse_fix(["tp=8", "pp=16", "recompute=yes", "zero=0"], cp=16) == \
        {"tp": 8, "pp": 16, "recompute": True, "zero": 0, "cp": 16}
    for items, kw, words in ((["tq=8"], {}, "--fix 'tq=8': give FIELD=VALUE with FIELD one of tp, cp"),
                             (["tp"], {}, "--fix 'tp': give FIELD=VALUE"),
                             (["tp=x"], {}, "--fix 'tp=x': tp must be a whole number >= 1"),
                             (["recompute=maybe"], {}, "recompute is yes or no"),
                             (["tp=2", "tp=4"], {}, "--fix gives tp twice (2 and 4)"),
                             (["cp=2"], {"cp": 4}, "--cp 4 and --fix cp=2 disagree")):
        with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
            parse_fix(items, **kw)


def run_cli(*args):
    return CliRunner().invoke(app, ["plan", "estimate", *map(str, args)],
                              env={"COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"})


def test_cli_calibration_and_fix(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 4,
                                  "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
                                  "vocab_size": 256}))
    common = ["--model-config", config, "--cluster", "h100-sxm", "--gpus", 8, "--seq-len", 2048,
              "--global-batch-tokens", 64 * 2048, "--fix", "tp=1", "--fix", "pp=1"]
    data = json.loads(run_cli(*common, "--json").output)
    assert (data["tp"], data["pp"], data["dp"]) == (1, 1, 8)
    result = run_cli(*common, "--calibrate-step-seconds", data["step_s"] * 2, "--json")
    assert result.exit_code == 0, result.output
    cal = json.loads(result.output)["calibration"]
    assert cal["measured_step_s"] == pytest.approx(2 * data["step_s"]) and cal["factor"] < 1
    table = run_cli(*common, "--calibrate-step-seconds", data["step_s"] * 2)
    assert "calibration: the measured" in table.output and "efficiency: {matmul:" in table.output
    bad = run_cli(*common, "--fix", "virtual=two")
    assert bad.exit_code == 1 and "Traceback" not in bad.output and "virtual must be a whole number" in bad.output
    fast = run_cli(*common, "--calibrate-step-seconds", 1e-9)
    assert fast.exit_code == 1 and "faster than" in fast.output.replace("\n", " ")
