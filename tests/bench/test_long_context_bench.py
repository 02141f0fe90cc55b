"""bench/long_context.py still runs (``--smoke``: a tiny Llama at 64 and 128 tokens, one process
against `cp` on 2 gloo processes) and reports every figure: per length and case the steady-state
peak RSS per rank, the peak above the baseline, step time and tokens/s, the ratios cp / one, the
tensors saved for backward, the cp plan's collectives, and the budget search (longest length that
fits, the affine fit); cp's losses equal the one-process losses within 1e-4 (relative) at every
length. The figures are the benchmark's business: no timing or memory ratio is checked."""
from __future__ import annotations

import pytest

from bench_smoke import run_smoke


@pytest.mark.multiprocess
@pytest.mark.slow
def test_long_context_bench_runs_and_reports(tmp_path):
    data = run_smoke("long_context.py", tmp_path)

    cfg = data["config"]
    lengths = cfg["lengths"]
    assert len(lengths) >= 2 and cfg["nproc"] == 2
    assert cfg["threads"]["cp"] * cfg["nproc"] <= max(cfg["cores"], cfg["nproc"])
    for t in lengths:
        row = data["lengths"][str(t)]
        for case, nproc in (("one", 1), ("cp", cfg["nproc"])):
            r = row[case]
            assert r["seq"] == t and r["nproc"] == nproc and len(r["per_rank"]) == nproc, (t, case)
            assert r["peak_rss"] >= r["steady_rss"] > 0 and r["baseline_rss"] > 0, (t, case, r)
            assert r["peak_above_baseline"] == max(x["peak_rss"] - x["baseline_rss"] for x in r["per_rank"])
            assert r["step_s"] > 0 and r["tokens_per_s"] > 0, (t, case)
            assert len(r["losses"]) == cfg["mem_warmup"] + cfg["mem_steps"], (t, case)
            assert r["held_bytes"] >= 4 * data["model"]["params"], (t, case)  # weights at least, replicated under cp
        # cp computes what one process computes: the same losses, every rank the same loss
        assert row["loss_rel_diff"] <= 1e-4, (t, row["loss_rel_diff"])
        assert row["cp"]["loss_spread_over_ranks"] == 0.0
        for one, cp in zip(row["one"]["losses"], row["cp"]["losses"]):
            assert abs(cp - one) <= 1e-4 * abs(one), (t, one, cp)
        ratios = data["ratios_cp_over_one"][str(t)]
        for key in ("peak_rss", "peak_above_baseline", "step_time", "tokens_per_s"):
            assert ratios[key] > 0, (t, key)
    assert data["losses_ok"]
    assert set(data["target"]) >= {"target", "met_on_peak_rss", "met_on_peak_above_baseline"}

    # the census of saved tensors at the budget length: cp keeps its own rows
    census = data["lengths"][str(cfg["budget_at"])]
    one_saved = census["one"]["per_rank"][0]["saved_for_backward"]
    assert one_saved["saved_bytes"] > 0
    for r in census["cp"]["per_rank"]:
        kinds = r["saved_for_backward"]["by_kind"]
        assert kinds["local_rows"] > 0 and sum(kinds.values()) == r["saved_for_backward"]["saved_bytes"]

    plan = data["cp_plan"]
    assert plan["ring_attention_calls"] >= cfg["layers"]  # every layer's attention is ring attention
    assert plan["plan_report"]

    budget = data["budget"]
    assert budget["bytes"] == data["lengths"][str(cfg["budget_at"])]["one"]["peak_rss"]
    for case in ("one", "cp"):
        b = budget[case]
        assert {"longest_fitting", "shortest_not_fitting", "fit_estimate_tokens", "points", "probes"} <= set(b)
        assert len(b["probes"]) <= cfg["budget_probes"]
        for p in b["points"]:
            assert not p["fits"] or p["peak_rss"] <= budget["bytes"], (case, p)
        if b["longest_fitting"] is not None:
            assert any(p["seq"] == b["longest_fitting"] and p["fits"] for p in b["points"])
        if b["shortest_not_fitting"] is not None:
            assert any(p["seq"] == b["shortest_not_fitting"] and not p["fits"] for p in b["points"])
    # the budget is one process's peak at budget_at: that length fits it
    assert budget["one"]["longest_fitting"] >= cfg["budget_at"]
