"""PlanReport: JSON round trip, the text rendering (collapsed layers, totals) and its warnings."""
from __future__ import annotations

import json

import pytest

from nnscaler.ir.contracts import PlanReport
from nnscaler.ir.contracts.plan_report import (REPLICATED_WARN_FRACTION, Collective, ModuleReport, OpSplit,
                                               UnannotatedOp)

LAYERS = 12


def _layer(i: int, sharded: bool = True):
    """One transformer-like layer: a block with attention (q, o) and a layer norm."""
    p = f"h.{i}"
    return [
        ModuleReport(p, "Block", [OpSplit("add", None, 2)], 0, 0, 0, 0),
        ModuleReport(f"{p}.ln", "LayerNorm", [OpSplit("layer_norm", None)], 0, 2, 0, 64),
        ModuleReport(f"{p}.attn", "Attention", [OpSplit("view", "d2", 3), OpSplit("softmax", "d1")], 0, 0, 0, 0),
        ModuleReport(f"{p}.attn.q", "Linear", [OpSplit("linear", "n" if sharded else None)],
                     2 if sharded else 0, 0 if sharded else 2, 1056 if sharded else 0, 0 if sharded else 1056),
        ModuleReport(f"{p}.attn.o", "Linear", [OpSplit("linear", "k")], 1, 1, 1024, 32),
    ]


def _report(**kw) -> PlanReport:
    modules = [ModuleReport("", "Net", [OpSplit("cross_entropy", None)]),
               ModuleReport("wte", "Embedding", [OpSplit("embedding", None)], 0, 1, 0, 4096)]
    for i in range(LAYERS):
        modules += _layer(i, sharded=i != 5)  # layer 5 differs: it must not be collapsed away
    args = dict(module_class="pkg.Net", policy="megatron", plan_ngpus=2, runtime_ngpus=4, modules=modules,
                forward=[Collective("all_reduce", 24, 24 * 1024)],
                backward=[Collective("all_reduce", 24, 24 * 1024), Collective("all_gather", 1, 512)],
                unannotated=[UnannotatedOp("torch.logcumsumexp", "model.py:12: h = torch.logcumsumexp(h, -1)",
                                           "h.0", 3)],
                bytes_per_device=[30000, 30000], dp_grad_bytes=30144)
    args.update(kw)
    return PlanReport(**args)


def test_json_round_trip_is_exact():
    report = _report(pipeline={"nstages": 2, "nmicros": 4, "scheduler": "1f1b", "pp_size": 2, "tp_size": 1,
                               "stages": {0: ["wte", "h.0"], 1: ["h.1"]}})
    text = json.dumps(report.to_json())  # plain JSON: no pickle, no custom encoder
    back = PlanReport.from_json(json.loads(text))
    assert back == report
    assert back.render_text() == report.render_text()
    with pytest.raises(ValueError, match="not a plan report of version"):
        PlanReport.from_json({**report.to_json(), "version": 99})


def test_totals_add_up_over_modules():
    report = _report()
    assert report.params_sharded == 11 * 2 + 12 * 1  # q (2) in 11 layers, o (1) in all 12
    assert report.params_replicated == 1 + 12 * 2 + 2 + 12 * 1
    assert report.bytes_sharded == 11 * 1056 + 12 * 1024
    assert report.bytes_replicated == 4096 + 12 * 64 + 1056 + 12 * 32
    assert report.dp_size == 2
    assert report.collectives("step") == {"all_reduce": (48, 48 * 1024), "all_gather": (1, 512)}
    assert report.total_calls() == 49


def test_text_collapses_identical_layers_and_keeps_different_ones():
    text = _report().render_text()
    lines = text.splitlines()
    assert lines[0] == "Plan report: pkg.Net"
    assert "policy megatron; plan_ngpus 2 x data-parallel 2 (runtime_ngpus 4)" in text
    # h.0..h.4 and h.6..h.11 are identical and collapse; h.5 (q replicated) stands alone
    rows = [ln.strip().split("  ")[0] for ln in lines if ln.strip().startswith("h.")]
    assert rows == ["h.0..h.4 (x5, each)", "h.5", "h.6..h.11 (x6, each)"]
    assert len(lines) < 40  # readable whatever the depth
    assert "linear[n]" in text and "linear[k]" in text and "replicated" in text
    assert "forward:  24 calls, 24.0 KiB (all_reduce x24 24.0 KiB)" in text
    assert "torch.logcumsumexp x3: model.py:12: h = torch.logcumsumexp(h, -1)" in text
    assert "backward: 25 calls, 24.5 KiB (all_gather x1 512 B; all_reduce x24 24.0 KiB)" in text
    assert "data-parallel gradient all-reduce: 29.4 KiB per step" in text


def test_text_shows_the_pipeline_stages():
    report = _report(pipeline={"nstages": 2, "nmicros": 4, "scheduler": "1f1b", "pp_size": 2, "tp_size": 1,
                               "stages": {0: ["wte", "h.0", "h.1", "h.2"], 1: ["h.3", "lm_head"]}})
    text = report.render_text()
    assert "pipeline: 2 stages on 2 pipeline devices x tp 1, 4 micro-batches, scheduler 1f1b" in text
    assert "stage 0: wte, h.0..h.2" in text and "stage 1: h.3, lm_head" in text
    assert "per micro-batch, summed over stages" in text


def test_warning_when_most_bytes_are_replicated():
    report = _report()
    assert report.replicated_fraction < REPLICATED_WARN_FRACTION
    assert report.warnings() == []
    # the same plan with wte 100x larger: most bytes replicated
    heavy = _report()
    heavy.modules[1].bytes_replicated = 400_000
    assert heavy.replicated_fraction > REPLICATED_WARN_FRACTION
    (message,) = heavy.warnings()
    assert f"policy 'megatron' over plan_ngpus=2 leaves {100 * heavy.replicated_fraction:.0f}% of the " \
           f"parameter bytes replicated" in message
    assert "largest replicated modules: wte (Embedding, 390.6 KiB)" in message
    assert "torch.logcumsumexp x3 at model.py:12" in message
    assert "nnscaler.register_op(torch.logcumsumexp" in message and "pas_config" in message


def test_warning_when_nothing_is_sharded_but_collectives_run():
    modules = [ModuleReport("fc", "Linear", [OpSplit("linear", None)], 0, 2, 0, 100),
               ModuleReport("", "Net", [OpSplit("sum", "b")])]
    report = PlanReport("pkg.Net", "tp", 2, 2, modules, forward=[Collective("all_gather", 1, 8)])
    (message,) = report.warnings()
    assert "shards no parameter but sends 1 collectives per step" in message
    # nothing to say with one device per unit, or without collectives and parameters
    assert PlanReport("pkg.Net", "dp", 1, 2, modules).warnings() == []
    assert PlanReport("pkg.Net", "tp", 2, 2, [ModuleReport("", "Net", [OpSplit("relu", None)])]).warnings() == []


def test_cp_keeps_the_weights_whole_without_a_warning():
    modules = [ModuleReport("fc", "Linear", [OpSplit("linear", "s")], 0, 2, 0, 100)]
    collectives = [Collective("all_gather", 1, 8)]
    assert PlanReport("pkg.Net", "tp", 2, 2, modules, forward=collectives).warnings()  # the same plan under tp: warned
    assert PlanReport("pkg.Net", "cp", 2, 2, modules, forward=collectives).warnings() == []
