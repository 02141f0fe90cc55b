"""bench/moe.py still runs (``--smoke``: a tiny DeepSeek-V3 on 2 gloo processes, `ep` against `dp`) and
reports every figure: step time and tokens/s of both, parameter bytes per rank (ep holds half the
expert weights), steady-state peak RSS per rank, and the experts' all-to-all payload a step equal
to the analytic count (measured / analytic == 1.0 exactly, over the ranks and per rank). The
figures are the benchmark's business: no timing is checked."""
from __future__ import annotations

import pytest

from bench_smoke import run_smoke


@pytest.mark.multiprocess
@pytest.mark.slow
def test_moe_bench_runs_and_reports(tmp_path):
    data = run_smoke("moe.py", tmp_path)

    cfg = data["config"]
    assert cfg["model"] == "deepseek_v3" and list(data["by_nproc"]) == ["2"] and cfg["nproc"] == 2
    assert data["by_nproc"]["2"]["ratios"] == data["ratios"]
    for case in ("dp", "ep"):
        assert data["step_time"]["median_s"][case] > 0 and data["step_time"]["tokens_per_s"][case] > 0
        pb = data["param_bytes"][case]
        assert 0 < pb["expert_bytes"] < pb["total_bytes"] <= pb["held_bytes"], (case, pb)
        assert len(pb["per_rank"]) == cfg["nproc"]
        mem = data["memory"][case]
        assert mem["peak_rss"] >= mem["steady_rss"] > 0 and mem["baseline_rss"] > 0, (case, mem)
    # dp: every rank the whole model; ep: each rank half of every layer's experts
    dp, ep = data["param_bytes"]["dp"], data["param_bytes"]["ep"]
    assert dp["expert_bytes"] == data["model"]["expert_param_bytes"]
    assert dp["total_bytes"] == data["model"]["param_bytes"]
    assert ep["expert_bytes"] * cfg["nproc"] == dp["expert_bytes"]
    # the rest replicated, but for ops the plan splits along a weight's dim (RMSNorm's weight * x)
    assert 0.9 * (dp["total_bytes"] - dp["expert_bytes"]) <= ep["total_bytes"] - ep["expert_bytes"]
    assert ep["total_bytes"] - ep["expert_bytes"] <= dp["total_bytes"] - dp["expert_bytes"]
    for key in ("expert_param_bytes_per_rank ep/dp", "param_bytes_per_rank ep/dp", "step_time ep/dp",
                "tokens_per_s ep/dp", "peak_rss ep/dp"):
        assert data["ratios"][key] > 0, key
    assert data["ratios"]["expert_param_bytes_per_rank ep/dp"] == 1 / cfg["nproc"]

    a2a = data["all_to_all"]
    L, T, k, h, n = cfg["layers"], cfg["batch"] * cfg["seq"], cfg["top_k"], cfg["hidden"], cfg["nproc"]
    assert a2a["analytic_bytes_per_step_sum_over_ranks"] == 4 * L * T * k * h * 4
    assert a2a["measured_over_analytic"] == 1.0
    assert a2a["measured_over_analytic_min_max_over_steps"] == [1.0, 1.0]
    assert a2a["per_rank_measured_over_exact"] == [1.0] * n
    assert a2a["exact_every_step"] and data["all_to_all_exact"]
    assert a2a["steps_checked"] == cfg["warmup"] + cfg["rounds"] * cfg["block"]
    for step in a2a["steps"]:
        assert all(r["calls"] == 4 * L for r in step["per_rank"]), step
    assert data["losses_ok"], data["loss_rel_diff_ep_vs_dp"]
