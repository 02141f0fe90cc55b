"""parallelize(..., verbose=True) and the plan report in the gen_savedir: printed on rank 0 (also
when the code is reused), kept as plan_report.json / .txt in the manifest, and PlanWarning for
plans that split little (attributed to the user's parallelize call)."""
from __future__ import annotations

import contextlib
import io
import json
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import toy_models
from gpt import GPT, GPTConfig, random_batch
from launch import run_workers
from nnscaler import ComputeConfig, parallelize
from nnscaler.ir.contracts import PlanReport
from nnscaler.runtime import PlanWarning
from nnscaler.runtime.driver.gen_dir import read_manifest, sha256_file
from nnscaler.runtime.driver.plan_report import load_plan_report, report_plan

ARGS = toy_models.mlp_batch(0, 4)
GPT_CFG = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)


def _instance_dir(root):
    (manifest,) = root.rglob("manifest.json")
    return manifest.parent


def _plan_warnings(record):
    return [w for w in record if issubclass(w.category, PlanWarning)]


def test_verbose_prints_the_report_and_the_files_are_in_the_manifest(tmp_path, capsys):
    torch.manual_seed(0)
    pm = parallelize(toy_models.MLP(), ARGS, "dp", ComputeConfig(1, 1, trace_strategy="cpu"),
                     gen_savedir=tmp_path, verbose=True)
    assert pm is not None
    out = capsys.readouterr().out
    directory = _instance_dir(tmp_path)
    text = (directory / "plan_report.txt").read_text()
    assert out == f"nnscaler: plan generated in {directory}\n{text}"
    report = PlanReport.from_json(json.loads((directory / "plan_report.json").read_text()))
    assert report.render_text() == text
    assert report.policy == "dp" and report.params_replicated == 6 and report.params_sharded == 0
    files = read_manifest(directory)["files"]
    for name in ("plan_report.json", "plan_report.txt"):
        assert files[name] == {"sha256": sha256_file(directory / name), "size": (directory / name).stat().st_size}


def test_reuse_prints_the_stored_report_and_quiet_prints_nothing(tmp_path, capsys):
    cfg = ComputeConfig(1, 1, trace_strategy="cpu")
    parallelize(toy_models.MLP(), ARGS, "dp", cfg, gen_savedir=tmp_path)
    assert capsys.readouterr().out == ""  # verbose=False: nothing printed
    directory = _instance_dir(tmp_path)
    generated = (directory / "gencode0.py").stat().st_mtime_ns
    parallelize(toy_models.MLP(), ARGS, "dp", cfg, gen_savedir=tmp_path, verbose=True)
    assert (directory / "gencode0.py").stat().st_mtime_ns == generated  # reused, not regenerated
    out = capsys.readouterr().out
    assert out == f"nnscaler: plan reused from {directory}\n{(directory / 'plan_report.txt').read_text()}"
    assert "Plan report: toy_models.MLP" in out


def replicate_everything(graph, cfg):
    """A user policy that splits nothing: every op whole on every device of the unit."""
    from nnscaler.policies import assign, replicate
    for node in graph.nodes:
        for device, piece in enumerate(replicate(graph, node, cfg.plan_ngpus)):
            assign(piece, device)
    return graph


def test_a_plan_that_replicates_everything_warns_at_the_users_call(tmp_path):
    cfg = ComputeConfig(2, 2, trace_strategy="cpu")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        parallelize(toy_models.MLP(), ARGS, replicate_everything, cfg, gen_savedir=tmp_path, load_module=False)
    (w,) = _plan_warnings(record)
    assert w.filename == __file__  # the user's parallelize call, not nnscaler's internals
    message = str(w.message)
    assert "leaves 100% of the parameter bytes replicated" in message
    assert "parameters: sharded 0 (0 B), replicated 6 (3.2 KiB)" in message
    assert "largest replicated modules: layers.0 (Linear, 1.1 KiB)" in message
    assert "pas_config" in message and "plan_report.txt" in message
    # the warning comes again when the code is reused: the plan still splits nothing
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        parallelize(toy_models.MLP(), ARGS, replicate_everything, cfg, gen_savedir=tmp_path, load_module=False)
    assert len(_plan_warnings(record)) == 1


class Bilinear(nn.Module):
    """Its weights are read only by F.bilinear, which has no dimension annotation."""

    def __init__(self, dim: int = 8):
        super().__init__()
        self.b1 = nn.Bilinear(dim, dim, dim)

    def forward(self, x, y):
        return F.mse_loss(torch.tanh(self.b1(x, x)).sum(-1), y)


def test_tp_on_unannotated_ops_warns_with_the_op_and_register_op(tmp_path):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        parallelize(Bilinear(), {"x": torch.randn(4, 8), "y": torch.randn(4)}, "tp",
                    ComputeConfig(2, 2, trace_strategy="cpu"), gen_savedir=tmp_path, load_module=False)
    (w,) = _plan_warnings(record)
    message = str(w.message)
    assert "policy 'tp' over plan_ngpus=2 shards no parameter but sends" in message
    assert "torch.nn.functional.bilinear x1 at test_parallelize_report.py:" in message
    assert "return F.mse_loss(torch.tanh(self.b1(x, x)).sum(-1), y)" in message  # the user's line
    assert "nnscaler.register_op(torch.nn.functional.bilinear, '<annotation>')" in message


def test_megatron_on_the_toy_gpt_does_not_warn(tmp_path):
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        parallelize(GPT(GPT_CFG), random_batch(0, 4, GPT_CFG), "megatron", ComputeConfig(2, 2, trace_strategy="cpu"),
                    gen_savedir=tmp_path, load_module=False)
    assert _plan_warnings(record) == []
    report = load_plan_report(_instance_dir(tmp_path))
    assert report.params_sharded == 10 * GPT_CFG.n_layer and report.replicated_fraction < 0.5


def test_missing_or_unreadable_report(tmp_path, capsys):
    assert report_plan(tmp_path, verbose=True, reused=True) is None  # code from an older nnscaler
    assert "no plan report in" in capsys.readouterr().out
    (tmp_path / "plan_report.json").write_text("{not json")
    with pytest.warns(PlanWarning, match="plan_report.json is unreadable"):
        assert report_plan(tmp_path, verbose=False, reused=True) is None


def _verbose_job(rank, world, gen_dir):
    torch.manual_seed(0)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        pm = parallelize(GPT(GPT_CFG), random_batch(0, 4, GPT_CFG), "tp", ComputeConfig(2, 2, trace_strategy="cpu"),
                         gen_savedir=gen_dir, verbose=True)
    loss = pm(**random_batch(1, 4, GPT_CFG))
    return out.getvalue(), [str(w.message) for w in _plan_warnings(record)], float(loss)


@pytest.mark.multiprocess
def test_verbose_prints_on_rank_0_only(tmp_path):
    (out0, warn0, loss0), (out1, warn1, loss1) = run_workers(_verbose_job, 2, str(tmp_path), timeout=120)
    directory = _instance_dir(tmp_path)
    assert out0 == f"nnscaler: plan generated in {directory}\n{(directory / 'plan_report.txt').read_text()}"
    assert "policy tp; plan_ngpus 2" in out0
    assert out1 == "" and warn1 == []
    report = load_plan_report(directory)
    assert len(warn0) == len(report.warnings())  # rank 0 warns exactly when the report says so
    assert loss0 == loss1
