"""``nnscaler plan estimate`` (nnscaler.policies.estimate.cli), in process through the ``nnscaler``
command's plug-in: the table, ``--json``, ``--save`` (a Trainer configuration that runs the plan)
and one-line errors."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from nnscaler.cli.main import app
from nnscaler.ir import ComputeConfig
from nnscaler.policies import check_pas_config, resolve_policy

TINY = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 128}


def run(*args):
    return CliRunner().invoke(app, ["plan", "estimate", *map(str, args)],
                              env={"COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"})


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    return path


def args(config, cluster="h100-sxm", gpus=16, seq=128, tokens=64 * 128):
    return ["--model-config", config, "--cluster", cluster, "--gpus", gpus, "--seq-len", seq,
            "--global-batch-tokens", tokens]


def test_json_has_the_plan_and_its_prediction(config):
    result = run(*args(config), "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    for key in ("tp", "pp", "dp", "zero", "micro_batch", "recompute", "step_s", "tflops_per_gpu", "mfu", "memory_gb"):
        assert key in data
    assert data["tp"] * data["pp"] * data["dp"] == 16
    assert data["step_s"] > 0 and 0 < data["mfu"] < 1 and data["memory_gb"] > 0
    assert data["tflops_per_gpu"] == pytest.approx(data["mfu"] * 989, rel=1e-9)
    assert data["runners_up"] and all(r["reason"] for r in data["runners_up"])


def test_table(config):
    result = run(*args(config))
    assert result.exit_code == 0, result.output
    assert "plan: tp" in result.output and "MFU" in result.output and "lost on" in result.output
    assert "run it: pas_policy" in result.output


@pytest.mark.parametrize("fixed", [None, {"tp": 2, "pp": 2}, {"tp": 1, "pp": 4, "virtual": 1}, {"tp": 2, "pp": 1}])
def test_saved_plan_configures_the_trainer(config, tmp_path, fixed):
    from nnscaler.policies.estimate import ModelSpec, Workload, load_cluster, result_json, search
    spec = ModelSpec.from_hf_config(config)
    cluster, work = load_cluster("h100-sxm"), Workload(16, 128, 64 * 128)
    data = result_json(search(spec, cluster, work, fixed=fixed), spec, cluster, work)
    t = data["trainer"]
    cfg = ComputeConfig(**{k: v for k, v in t["compute_config"].items()})
    assert cfg.plan_ngpus == data["tp"] * data["pp"] and cfg.runtime_ngpus == 16
    assert cfg.zero_stage == data["zero"]
    resolve_policy(t["pas_policy"])
    check_pas_config(t["pas_policy"], cfg.pas_config)  # only keys the policy reads
    assert t["micro_batch_size"] * t["grad_accumulation_steps"] * data["dp"] == 64
    if data["pp"] > 1:
        assert cfg.pas_config["pipeline_pivots"] == "LlamaDecoderLayer"
    if data["recompute"]:
        assert cfg.pas_config["recompute_modules"] == "LlamaDecoderLayer"


def test_save_writes_the_plan_file(config, tmp_path):
    out = tmp_path / "plans" / "plan.json"
    result = run(*args(config), "--save", out)
    assert result.exit_code == 0, result.output
    saved = json.loads(out.read_text())
    assert saved["format"] == "nnscaler-estimate-plan" and saved["version"] == 1
    assert saved["trainer"]["compute_config"]["runtime_ngpus"] == 16


@pytest.mark.parametrize("change, words", [
    ({"cluster": "h900"}, ["Error:", "'h900' is neither a shipped description"]),
    ({"tokens": 1000}, ["Error:", "--global-batch-tokens (1000) must be a multiple of --seq-len (128)"]),
    ({"gpus": 12}, ["Error:", "--gpus (12) must fill whole nodes of 8"]),
])
def test_errors_are_one_line(config, change, words):
    kw = dict(cluster="h100-sxm", gpus=16, seq=128, tokens=64 * 128)
    kw.update(change)
    result = run(*args(config, **kw))
    assert result.exit_code == 1
    assert "Traceback" not in result.output
    for w in words:
        assert w in result.output.replace("\n", " ")


def test_a_bad_cluster_file_is_named(config, tmp_path):
    bad = tmp_path / "mine.yaml"
    bad.write_text("gpu: {name: H100-SXM-80GB}\ngpus_per_node: 8\nintra_node: {gbps: 450, latency_us: 3}\n")
    result = run(*args(config, cluster=bad))
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "mine.yaml" in result.output and "missing key 'inter_node'" in result.output


def test_zero_gpus_is_refused_by_the_option(config):
    result = run(*args(config, cluster="local", gpus=0))
    assert result.exit_code == 2 and "--gpus" in result.output and "Traceback" not in result.output


def test_missing_model_config(tmp_path):
    result = run(*args(tmp_path / "none.json"))
    assert result.exit_code == 1 and "cannot read the model config" in result.output


def test_piped_output_keeps_each_line_whole(config):
    """Not a terminal (a pipe, CliRunner): no line broken mid-phrase even with a narrow COLUMNS (issue 45 §4:
    ``memory 71.7 \\nGB per GPU``)."""
    result = CliRunner().invoke(app, ["plan", "estimate", *map(str, args(config))],
                                env={"COLUMNS": "40", "NO_COLOR": "1", "TERM": "dumb"})
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    step = next(line for line in lines if line.strip().startswith("step "))
    assert "MFU" in step and step.rstrip().endswith("GB per GPU"), step
    run_it = next(line for line in lines if "run it:" in line)
    assert "grad_accumulation_steps" in run_it  # the whole fragment on one line
    assert any("lost on" in line and "memory GB" in line for line in lines)  # the table's header unbroken
