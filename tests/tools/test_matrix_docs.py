"""tools/matrix_docs.py: docs/compatibility.md is generated from bench/results/matrix.json, and the
published page agrees with the last run (this test fails when they disagree)."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))

import matrix  # noqa: E402
import matrix_cases as mc  # noqa: E402
import matrix_docs as md  # noqa: E402


def _results():
    cases = mc.select(mc.generate(), {"model": ["gpt2"], "plan": ["dp"], "zero": ["none"]})
    states = [{"state": "parity"}, {"state": "refused", "error": "ConfigError: no | good"}]
    return {"seed": mc.SEED, "commit": "abc1234", "date": "2026-12-02 03:00 UTC",
            "cases": {c["id"]: s for c, s in zip(cases, states)}}, cases


def test_page_shows_every_state_date_commit_and_what_did_not_run():
    results, cases = _results()
    page = md.render(results)
    assert "`abc1234`" in page and "2026-12-02 03:00 UTC" in page
    row = next(line for line in page.splitlines() if line.startswith("| gpt2 | dp |"))
    assert row.split(" | ")[2:4] == ["✅", "⛔ [1]"] and row.count(md.NOT_RUN) == 4
    assert "1. refused: ConfigError: no / good" in page  # a reason never breaks the table
    assert f"Cells run: 2 of {len(mc.TABLE_AXES['model']) * len(mc.TABLE_AXES['plan']) * 6}" in page
    results["cases"][cases[0]["id"]] = {"state": "hang", "error": "timed out"}
    assert "❌ [1]" in md.render(results)


def test_check_finds_a_page_that_disagrees():
    results, cases = _results()
    page = md.render(results)
    assert md.check(page, results) == ""
    results["cases"][cases[0]["id"]] = {"state": "differs", "error": "x differs"}
    assert "line" in md.check(page, results)
    assert md.check("no table here", results)


def test_published_page_agrees_with_the_last_run():
    with open(matrix.DOCS, encoding="utf-8") as f:
        page = f.read()
    problem = md.check(page, matrix.load_results(matrix.RESULTS))
    assert not problem, f"docs/compatibility.md disagrees with bench/results/matrix.json ({problem}): " \
                        f"run `python tools/matrix.py --docs`"
