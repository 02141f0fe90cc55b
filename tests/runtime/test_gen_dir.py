"""ReuseType: every row of the seed's table, on real generated directories (single process)."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

from nnscaler import ComputeConfig, ReuseType, parallelize
from nnscaler.runtime import ReuseError
from nnscaler.runtime.driver.gen_dir import ReuseDecision, Identity, decide, instance_dir


TRACE_RUNS = 2  # a trace runs the forward once per mode (training and eval: nnscaler.ir.tracer.modes)


class Counting(nn.Module):
    """Counts its forward calls, so a test can tell whether it was traced again."""

    calls = 0

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        type(self).calls += 1
        return self.fc(x).sum()


ARGS = {"x": torch.ones(2, 4)}


def cfg(**kw):
    return ComputeConfig(1, 1, trace_strategy="cpu", **kw)


def gen(tmp_path, reuse, config=None, module=None):
    return parallelize(module or Counting(), ARGS, "dp", config or cfg(), gen_savedir=tmp_path, reuse=reuse)


def files(tmp_path):
    d = instance_dir(tmp_path, f"{Counting.__module__}.Counting", None)
    return d, {p.name: p.stat().st_mtime_ns for p in d.iterdir()}


def test_match_generates_when_nothing_exists_then_reuses(tmp_path):
    gen(tmp_path, "match")
    d, before = files(tmp_path)
    assert {"gencode0.py", "manifest.json", "graph.json", "fullmodel.safetensors"} <= set(before)
    calls = Counting.calls
    pm = gen(tmp_path, ReuseType.MATCH)
    assert Counting.calls == calls, "match must not trace again"
    assert files(tmp_path)[1] == before
    assert pm(torch.ones(2, 4)).shape == ()


def test_match_refuses_a_different_config_and_names_the_field(tmp_path):
    gen(tmp_path, "match")
    with pytest.raises(ReuseError, match=r"compute_config\.use_async_reducer: existing False, now True"):
        gen(tmp_path, "match", cfg(use_async_reducer=True))


def test_match_refuses_changed_generated_code_naming_the_file(tmp_path):
    gen(tmp_path, "match")
    d, _ = files(tmp_path)
    (d / "gencode0.py").write_text((d / "gencode0.py").read_text() + "\n# edited\n")
    with pytest.raises(ReuseError, match=r"gencode0\.py: size"):
        gen(tmp_path, "match")


def test_override_regenerates_everything(tmp_path):
    gen(tmp_path, "match")
    _, before = files(tmp_path)
    calls = Counting.calls
    gen(tmp_path, "override")
    _, after = files(tmp_path)
    assert Counting.calls == calls + TRACE_RUNS
    assert all(after[n] != before[n] for n in ("gencode0.py", "graph.json", "manifest.json"))


def test_moo_reuses_on_match_and_regenerates_otherwise(tmp_path):
    gen(tmp_path, "moo")
    _, before = files(tmp_path)
    gen(tmp_path, "moo")
    assert files(tmp_path)[1] == before
    gen(tmp_path, "moo", cfg(use_async_reducer=True))
    d, after = files(tmp_path)
    assert after["gencode0.py"] != before["gencode0.py"]
    assert json.loads((d / "manifest.json").read_text())["compute_config"]["use_async_reducer"] is True


def test_graph_reuses_the_traced_graph_when_only_codegen_settings_change(tmp_path):
    gen(tmp_path, "graph")
    _, before = files(tmp_path)
    calls = Counting.calls
    gen(tmp_path, "graph", cfg(pas_config={"_note": "codegen only"}))
    _, after = files(tmp_path)
    assert Counting.calls == calls, "graph reuse must not trace again"
    assert after["graph.json"] == before["graph.json"]
    assert after["gencode0.py"] != before["gencode0.py"]
    # a change that shapes the graph (constant folding) traces again
    gen(tmp_path, "graph", cfg(constant_folding=True))
    assert Counting.calls == calls + TRACE_RUNS


def test_reuse_accepts_enum_and_value_and_rejects_others(tmp_path):
    assert ReuseType.parse("MOO") is ReuseType.MOO
    with pytest.raises(ValueError, match="reuse must be one of match, override, moo, graph"):
        gen(tmp_path, "sometimes")


def test_corrupt_manifest_is_reported(tmp_path):
    gen(tmp_path, "match")
    d, _ = files(tmp_path)
    (d / "manifest.json").write_text("{not json")
    with pytest.raises(ReuseError, match="manifest .* is unreadable"):
        gen(tmp_path, "match")
    gen(tmp_path, "override")  # the way out the message names works


def test_decide_without_existing_code_generates(tmp_path):
    ident = Identity("m.C", cfg().to_dict(), "dp", {})
    for reuse in ReuseType:
        assert decide(tmp_path / "nothing", reuse, ident) is ReuseDecision.GENERATE


def test_code_from_another_nnscaler_version_is_not_a_match(tmp_path):
    gen(tmp_path, "match")
    d, _ = files(tmp_path)
    manifest = json.loads((d / "manifest.json").read_text())
    assert manifest["generator"]  # the hash of the tracer, policies and codegen that wrote it
    manifest["generator"] = "0123456789abcdef"
    (d / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ReuseError, match="generator: existing '0123456789abcdef'"):
        gen(tmp_path, "match")
    gen(tmp_path, "moo")  # regenerates
    assert json.loads((d / "manifest.json").read_text())["generator"] != "0123456789abcdef"
