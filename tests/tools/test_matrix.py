"""tools/matrix.py: the runner records every case as it ends and resumes where it stopped (a fake
runner here: no process), the CLI's filters and errors. CI's sample: test_matrix_sample.py."""
from __future__ import annotations

import io
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))

import matrix  # noqa: E402
import matrix_cases as mc  # noqa: E402



def _fake(seen):
    def runner(case):
        seen.append(case["id"])
        if case["plan"] == "cp":
            raise RuntimeError("boom")  # the harness failing on a case is recorded, not raised
        return {"state": "parity", "seconds": 0.0}
    return runner


def test_records_each_case_and_resumes(tmp_path):
    path = str(tmp_path / "m.json")
    cases = mc.select(mc.generate(), {"model": ["gpt2"], "plan": ["dp", "cp"], "zero": ["none"]})
    seen = []
    matrix.run(cases[:2], path, runner=_fake(seen), out=io.StringIO())
    first = json.load(open(path))
    assert set(first["cases"]) == {c["id"] for c in cases[:2]} and first["commit"] and first["date"]
    out = io.StringIO()
    matrix.run(cases, path, jobs=2, runner=_fake(seen), out=out)  # resumes: the first two are not run again
    assert sorted(seen) == sorted(c["id"] for c in cases)
    assert "2 already recorded" in out.getvalue() and f"{len(cases) - 2}/{len(cases) - 2}" in out.getvalue()
    records = json.load(open(path))["cases"]
    for c in cases:
        want = "crash" if c["plan"] == "cp" else "parity"
        assert records[c["id"]]["state"] == want
    assert records[next(c["id"] for c in cases if c["plan"] == "cp")]["error"] == "harness: RuntimeError: boom"
    seen.clear()
    matrix.run(cases, path, rerun=True, runner=_fake(seen), out=io.StringIO())
    assert len(seen) == len(cases)


def test_an_option_refused_on_its_own_reruns_the_cell_at_its_baseline(tmp_path):
    import matrix_docs
    path = str(tmp_path / "m.json")
    case = next(c for c in mc.generate() if c["dropout"] == "exact" and c["model"] == "llama" and c["plan"] == "dp")
    seen = []

    def runner(c):
        seen.append(c)
        if c["dropout"] == "exact":
            return {"state": "refused", "error": "GenerationError: ComputeConfig.rng_mode='exact' cannot ..."}
        return {"state": "parity"}
    results = matrix.run([case], path, runner=runner, out=io.StringIO())
    assert [c["dropout"] for c in seen] == ["exact", "off"]
    base = seen[1]
    assert base["id"].endswith("~base") and base["base_of"] == case["id"]
    assert {a: base[a] for a in mc.AXES} == dict({a: case[a] for a in mc.AXES}, dropout="off")
    assert results["cases"][case["id"]]["baseline"] == base["id"] and results["cases"][base["id"]]["state"] == "parity"
    page = matrix_docs.render(results)
    cols = [(z, r) for z in mc.TABLE_AXES["zero"] for r in mc.TABLE_AXES["recompute"]]
    row = next(line for line in page.splitlines() if line.startswith("| llama | dp |"))
    assert row.split(" | ")[2 + cols.index((case["zero"], case["recompute"]))].strip(" |") == "✅"
    assert f"`{case['id']}`: GenerationError: ComputeConfig.rng_mode" in page
    assert mc.baseline_for(case, "ConfigError: something else") is None


def test_a_batched_rerun_keeps_a_refused_options_link_to_its_baseline(tmp_path, monkeypatch):
    """`run_batched` reruns no baseline, but a refused option's new record keeps the link to the baseline
    record already there (without it the page counts that cell as refused)."""
    import matrix_batch
    path = str(tmp_path / "m.json")
    case = next(c for c in mc.generate() if c["dropout"] == "exact" and c["model"] == "llama" and c["plan"] == "dp")
    refused = {"state": "refused", "error": "GenerationError: ComputeConfig.rng_mode='exact' cannot ..."}
    matrix.run([case], path, runner=lambda c: dict(refused) if c["dropout"] == "exact" else {"state": "parity"},
               out=io.StringIO())
    base = json.load(open(path))["cases"][case["id"]]["baseline"]

    def run_batch(cases, on_record):
        for c in cases:
            on_record(c, dict(refused))
    monkeypatch.setattr(matrix_batch, "run_batch", run_batch)
    results = matrix.run_batched([case], path, rerun=True, out=io.StringIO())
    assert results["cases"][case["id"]]["baseline"] == base and results["cases"][base]["state"] == "parity"


def test_refuses_results_of_another_seed(tmp_path):
    path = tmp_path / "m.json"
    path.write_text(json.dumps({"seed": mc.SEED + 1, "cases": {}}))
    with pytest.raises(SystemExit, match="seed"):
        matrix.run([], str(path), runner=_fake([]), out=io.StringIO())


def test_cli_list_and_bad_filter(capsys):
    assert matrix.main(["--list", "--model", "llama", "--plan", "cp,tp", "--zero", "3"]) == 0
    ids = capsys.readouterr().out.split()
    assert len(ids) == 4 and all(i.startswith(("llama/cp/3/", "llama/tp/3/")) for i in ids)
    assert matrix.main(["--list", "--plan", "fsdp"]) == 2
    assert "unknown value(s) ['fsdp'] for --plan" in capsys.readouterr().err
