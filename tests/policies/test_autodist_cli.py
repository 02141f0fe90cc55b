"""``nnscaler plan show PLAN.json``: the plug-in (entry point ``plan`` of nnscaler-policies) prints a
table per module (partition, estimated memory and time, stage) and the totals; a missing file,
bad JSON or a file that is not a plan exits 1 with a one-line error, no traceback."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

import gpt
from nnscaler.cli.main import app  # the `nnscaler` command itself: `plan` comes from the entry point
from nnscaler.cli.plugins import discover
from nnscaler.ir import ComputeConfig, trace
from nnscaler.policies import apply_policy
from nnscaler.policies.autodist import PlanRecord, save_plan
from nnscaler.policies.autodist.plan_file import OpRecord

COMM = {"backend": "given", "collectives": {c: {"2": [1e-5, 5e9]}
                                            for c in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")}}
MB = 2 ** 20


def run(*args):
    return CliRunner().invoke(app, list(map(str, args)), env={"COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"})


def lines_of(output):
    """The table rows as lists of cells (the box characters dropped)."""
    rows = []
    for line in output.splitlines():
        if line.startswith("│"):
            rows.append([c.strip() for c in line.strip("│").split("│")])
    return rows


def handmade(pipeline=True) -> PlanRecord:
    """A plan of a 2-stage pipeline with known numbers."""
    ops = [
        OpRecord("wte|embedding|0", "torch.nn.functional.embedding", "wte", "R", [[4, 8], [64, 32]], 0, 0.001, 1 * MB),
        OpRecord("h.0.attn|linear|0", "torch.nn.functional.linear", "h.0.attn", "n", [[4, 8, 32]], 0, 0.002, 2 * MB),
        OpRecord("h.0.attn|linear|1", "torch.nn.functional.linear", "h.0.attn", "n", [[4, 8, 32]], 0, 0.002, 2 * MB),
        OpRecord("h.0.mlp|gelu|0", "torch.nn.functional.gelu", "h.0.mlp", "R", [[4, 8, 128]], 0, 0.0005, 0.5 * MB),
        OpRecord("h.1.attn|linear|0", "torch.nn.functional.linear", "h.1.attn", "k", [[4, 8, 32]], 1, 0.004, 3 * MB),
        OpRecord("|add|0", "operator.add", "", "R", [[4, 8, 32], [4, 8, 32]], 1, 0.0001, 0.25 * MB),
    ]
    if not pipeline:
        for op in ops:
            op.stage = None
    estimate = {"time_s": 0.0125, "mem_bytes": 12 * MB, "transient_bytes": 1.5 * MB, "mem_limit_bytes": 16 * MB,
                "search_s": 0.25, "solver_s": 0.125, "profiled_ops": 3, "cached_ops": 5}
    return PlanRecord("gpt.GPT", 4, ops, estimate,
                      {"nstages": 2, "tp_size": 2, "nmicros": 4, "scheduler": "1f1b"} if pipeline else None,
                      "demo", "milp")


def test_the_plugin_is_registered():
    [plugin] = [p for p in discover() if p.name == "plan"]
    assert plugin.entry_point.value == "nnscaler.policies.autodist.cli:app" and not plugin.shadowed_by
    assert plugin.entry_point.dist.metadata["Name"] == "nnscaler-policies"


def test_help_lists_show():
    out = run("plan", "--help")
    assert out.exit_code == 0, out.output
    assert "show" in out.output


def test_show_handmade_plan(tmp_path):
    path = tmp_path / "plan.json"
    save_plan(handmade(), path)
    out = run("plan", "show", path)
    assert out.exit_code == 0, out.output
    text = out.output
    assert "autodist plan for gpt.GPT on plan_ngpus=4 (task demo, solver milp), 6 ops" in text
    assert "pipeline: 2 stages x 2 devices, 4 micro-batches, 1f1b schedule" in text
    rows = {r[0]: r for r in lines_of(text)}
    assert rows["wte"][1:] == ["R x1", "1.00", "1.000", "0"]
    assert rows["h.0.attn"][1:] == ["linear:n x2", "4.00", "4.000", "0"]
    assert rows["h.0.mlp"][1:] == ["R x1", "0.50", "0.500", "0"]
    assert rows["h.1.attn"][1:] == ["linear:k", "3.00", "4.000", "1"]
    assert rows["(root)"][1:] == ["R x1", "0.25", "0.100", "1"]
    assert rows["5 modules"][1:] == ["6 ops", "8.75", "9.600", ""]
    assert [r[0] for r in lines_of(text)][:5] == ["wte", "h.0.attn", "h.0.mlp", "h.1.attn", "(root)"]  # program order
    assert "total: estimated step time 12.500 ms, memory per device 12.00 MB (of which transient 1.50 MB), limit 16.00 MB" in text
    assert "search 0.250 s; solver 0.125 s; ops profiled 3, from the cache 5" in text


def test_show_depth_groups_module_paths(tmp_path):
    path = tmp_path / "plan.json"
    save_plan(handmade(), path)
    out = run("plan", "show", path, "--depth", "1")
    assert out.exit_code == 0, out.output
    rows = {r[0]: r for r in lines_of(out.output)}
    assert set(rows) == {"wte", "h", "(root)", "3 modules"}
    assert rows["h"][1:] == ["linear:n x2, linear:k, R x1", "7.50", "8.500", "0,1"]
    two = {r[0] for r in lines_of(run("plan", "show", path, "--depth", "2").output)}
    assert {"h.0", "h.1"} <= two and "h" not in two
    bad = run("plan", "show", path, "--depth", "0")
    assert bad.exit_code == 2 and "--depth" in bad.output


def test_show_without_pipeline_or_limit(tmp_path):
    record = handmade(pipeline=False)
    del record.estimate["mem_limit_bytes"]
    path = tmp_path / "plan.json"
    save_plan(record, path)
    out = run("plan", "show", path)
    assert out.exit_code == 0, out.output
    assert "pipeline:" not in out.output and ", limit" not in out.output
    assert {r[4] for r in lines_of(out.output)[:-1]} == {"-"}


def test_show_a_searched_plan(tmp_path):
    cfg = gpt.GPTConfig(n_layer=2)
    torch.manual_seed(0)
    graph = trace(gpt.GPT(cfg), gpt.random_batch(0, 4, cfg))
    path = tmp_path / "gpt.json"
    apply_policy(graph, ComputeConfig(2, 2, pas_config={"_comm_profile": COMM, "_profile_repeats": 1,
                                                        "save_plan_path": str(path)}), "autodist")
    out = run("plan", "show", path)
    assert out.exit_code == 0, out.output
    modules = [r[0] for r in lines_of(out.output)]
    for m in ("wte", "wpe", "h.0.attn", "h.0.mlp", "h.1.attn", "ln_f", "lm_head"):
        assert m in modules
    assert f"{len(graph.nodes)} ops" in out.output
    est = graph.autodist_plan.estimate
    assert f"estimated step time {est['time_s'] * 1e3:,.3f} ms" in out.output


def _one_line_error(out, *texts):
    assert out.exit_code == 1, out.output
    assert "Traceback" not in out.output
    assert out.exception is None or isinstance(out.exception, SystemExit)
    message = " ".join(out.output.split())  # rich may wrap a long line
    assert message.startswith("Error: ")
    for text in texts:
        assert text in message, message


def test_missing_file(tmp_path):
    _one_line_error(run("plan", "show", tmp_path / "none.json"), "cannot read the autodist plan",
                    "No such file or directory")


def test_directory(tmp_path):
    _one_line_error(run("plan", "show", tmp_path), "cannot read the autodist plan")


def test_bad_json(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"format": "nnscaler-autodist-plan", ')
    _one_line_error(run("plan", "show", path), "is not valid JSON")


@pytest.mark.parametrize("data,text", [
    ({"hello": 1}, "is not an autodist plan"),
    ([1, 2, 3], "is not an autodist plan"),
    ({"format": "nnscaler-autodist-plan", "version": 7}, "plan format version 7"),
    ({"format": "nnscaler-autodist-plan", "version": 1, "module_class": "M", "plan_ngpus": 2},
     "is a damaged autodist plan"),
    ({"format": "nnscaler-autodist-plan", "version": 1, "module_class": "M", "plan_ngpus": 2,
      "ops": [{"key": "a|b|0", "op": "b", "module": "a", "choice": "R", "shapes": [], "mem_bytes": "lots"}]},
     "mem_bytes must be numbers"),
    ({"format": "nnscaler-autodist-plan", "version": 1, "module_class": "M", "plan_ngpus": 2, "ops": [],
      "estimate": {"time_s": "fast"}}, "estimate 'time_s' must be a number"),
    ({"format": "nnscaler-autodist-plan", "version": 1, "module_class": "M", "plan_ngpus": 2, "ops": [],
      "pipeline": {"nstages": 2}}, "'pipeline' must be null or a mapping"),
])
def test_not_a_plan(tmp_path, data, text):
    path = tmp_path / "x.json"
    path.write_text(json.dumps(data))
    _one_line_error(run("plan", "show", path), str(path), text)


@pytest.mark.multiprocess  # a fresh interpreter: the installed `nnscaler` command
def test_plan_show_from_the_command_line(tmp_path):
    path = tmp_path / "plan.json"
    save_plan(handmade(), path)
    env = dict(os.environ, COLUMNS="200", NO_COLOR="1", TERM="dumb")
    ok = subprocess.run([sys.executable, "-m", "nnscaler.cli", "plan", "show", str(path)], env=env,
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "h.0.attn" in ok.stdout and "linear:n x2" in ok.stdout and "total: estimated step time" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "nnscaler.cli", "plan", "show", str(tmp_path / "none.json")],
                         env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and bad.stdout == ""
    assert "Traceback" not in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    assert bad.stderr.startswith("Error: cannot read the autodist plan")
