"""The measured parts of autodist's cost model: communication read off measured points, the
in-program collective timing, the whole-graph calibration of the ops' compute time, the optimizer's per-tensor
cost, and ZeRO's priced extras (nnscaler.policies.autodist: comm_model, graph_timing,
op_profile)."""
from __future__ import annotations

import json
import math

import pytest
import torch

import gpt
from nnscaler.ir import ComputeConfig, trace
from nnscaler.policies import apply_policy
from nnscaler.policies.autodist import AutodistConfig
from nnscaler.policies.autodist.comm_model import CommModel, monotone_points
from nnscaler.policies.autodist.graph_timing import calibration, calibration_key, graph_seconds
from nnscaler.policies.autodist.op_profile import ProfileDB, optimizer_rate, optimizer_tensor_cost, profile_graph
from nnscaler.policies.autodist.policy import _Search

LINE = {c: {"2": [1e-4, 1e9]} for c in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")}


def gpt_graph(n_layer=2):
    cfg = gpt.GPTConfig(n_layer=n_layer)
    torch.manual_seed(0)
    return trace(gpt.GPT(cfg), gpt.random_batch(0, 4, cfg))


# -- communication from measured points ----------------------------------------------------------
def test_times_are_read_off_the_measured_points():
    pts = [[1e4, 1e-4], [1e6, 1e-3], [1e7, 2e-2]]
    m = CommModel({"backend": "t", "collectives": {"p2p": {"2": [5e-5, 1e9, pts]}}})
    assert m.wire_time("p2p", 1e4, 2) == pytest.approx(1e-4)
    assert m.wire_time("p2p", 5.05e5, 2) == pytest.approx(5.5e-4)  # halfway between the first two points
    assert m.wire_time("p2p", 1e3, 2) == pytest.approx(1e-4)  # below the smallest: its time
    # beyond the largest: the last segment's slope
    assert m.wire_time("p2p", 2e7, 2) == pytest.approx(2e-2 + 1e7 * (2e-2 - 1e-3) / 9e6)
    assert m.latency("p2p", 2) == pytest.approx(1e-4) and m.latency("p2p", 1) == 0.0
    assert m.time("p2p", 1e6, 1) == 0.0


def test_a_line_profile_still_prices_as_a_line():
    m = CommModel({"backend": "t", "collectives": LINE})
    assert m.time("p2p", 1e6, 2) == pytest.approx(1e-4 + 1e6 / 1e9)


def test_a_small_message_slower_than_a_larger_one_is_noise():
    assert monotone_points([[1e4, 3e-3], [1e5, 4e-4], [1e6, 1e-3]]) == [(1e4, 4e-4), (1e5, 4e-4), (1e6, 1e-3)]


def test_a_group_in_a_larger_job_is_priced_as_measured_there():
    alone, beside = [1e-4, 1e9, [[1e4, 1e-4], [1e6, 1e-3]]], [1e-3, 1e8, [[1e4, 1e-3], [1e6, 1e-2]]]
    profile = {"backend": "t", "collectives": {"all_reduce": {"2": alone, "2/4": beside, "4": beside}}}
    assert CommModel(profile).latency("all_reduce", 2) == pytest.approx(1e-4)  # no job size: the lone group
    assert CommModel(profile, world=2).latency("all_reduce", 2) == pytest.approx(1e-4)
    assert CommModel(profile, world=4).latency("all_reduce", 2) == pytest.approx(1e-3)  # 2 groups at once
    assert CommModel(profile, world=8).latency("all_reduce", 2) == pytest.approx(1e-4)  # not measured: nearest size


def test_a_collectives_cpu_part_runs_at_the_jobs_load():
    """Where the job's processes outnumber the cores, the measured CPU share of a collective runs
    `load` times slower; its waiting part does not."""
    pts = [[1e4, 1e-3], [1e6, 1e-2]]
    profile = {"backend": "t", "collectives": {"all_reduce": {"2": [1e-3, 1e8, pts, 0.4]},
                                               "all_gather": {"2": [1e-3, 1e8, pts]},
                                               "p2p": {"2": [1e-3, 1e8, pts, 0.4]}}}
    alone, loaded = CommModel(profile), CommModel(profile, load=2.5)
    factor = 1 + 0.4 * (2.5 - 1)
    assert loaded.cpu_share("all_reduce", 2) == pytest.approx(0.4)
    assert loaded.latency("all_reduce", 2) == pytest.approx(alone.latency("all_reduce", 2) * factor)
    assert loaded.time("all_reduce", 4e5, 2) == pytest.approx(alone.time("all_reduce", 4e5, 2) * factor)
    assert loaded.time("all_gather", 4e5, 2) == pytest.approx(alone.time("all_gather", 4e5, 2))  # no share measured
    assert loaded.time("p2p", 4e5, 2) == pytest.approx(alone.time("p2p", 4e5, 2))  # timed beside the work already
    assert CommModel(profile, load=0.5).time("all_reduce", 4e5, 2) == pytest.approx(alone.time("all_reduce", 4e5, 2))


@pytest.mark.multiprocess
def test_groups_of_a_larger_job_are_measured_all_at_once(tmp_path, monkeypatch):
    from nnscaler.policies.autodist.comm_model import profile_key
    from nnscaler.policies.autodist.comm_profile import measured_comm_model
    monkeypatch.setenv("NNSCALER_CACHE_DIR", str(tmp_path))
    assert profile_key(2, 4) == "2/4" and profile_key(4, 4) == "4" and profile_key(2, None) == "2"
    assert profile_key(3, 4) == "3"  # 4 ranks are not groups of 3
    model = measured_comm_model([2], "cpu", world=4)  # 4 processes, 2 groups of 2 timing at once
    for coll, table in model.profile["collectives"].items():
        assert set(table) == {"2/4"}
        lat, bw, points, share = table["2/4"]
        assert lat > 0 and bw > 0 and len(points) == 5 and all(t > 0 for _, t in points)
        assert 0.0 < share <= 1.0  # a collective's processes work part of its time (gloo's threads)
    reduce = model.profile["collectives"]["all_reduce"]["2/4"]
    assert model.world == 4 and model.latency("all_reduce", 2) == pytest.approx(min(t for _, t in reduce[2]))
    again = measured_comm_model([2], "cpu", world=4)  # cached: the same numbers
    assert again.profile == model.profile


class _ScriptedClock:
    """`time` for comm_profile whose perf_counter advances by the scripted seconds of each chain
    in turn (the warm-up chain, then per repeat: work + collective, work alone, bare collective)."""

    def __init__(self, both, alone, bare):
        from nnscaler.policies.autodist import comm_profile
        self.chains = iter([both] + [both, alone, bare] * comm_profile._REPEATS)
        self.now, self.started = 0.0, False

    def perf_counter(self):
        if self.started:
            self.now += next(self.chains)
        self.started = not self.started
        return self.now

    @staticmethod
    def process_time():
        import time
        return time.process_time()


@pytest.mark.parametrize("both,alone,bare,expected", [
    (0.010, 0.004, 0.003, 0.006),  # what the collective adds to the chain
    (0.005, 0.004, 0.003, 0.003),  # never below the collective's own fastest chain
], ids=["added", "floor"])
def test_a_collective_is_timed_inside_a_running_program(tmp_path, monkeypatch, both, alone, bare, expected):
    """`_in_program` prices a collective as what it adds to a chain of work, never below the
    collective's own fastest time (a real one-rank gloo group; the clock scripted, so the test
    checks the arithmetic, not this machine's speed)."""
    import torch.distributed as dist
    from nnscaler.policies.autodist import comm_profile
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        x = torch.ones(1 << 16)
        work = torch.randn(128, 128)
        for coll in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
            seconds, share = comm_profile._in_program(dist, coll, x, 1, 0, 0, None, work, "gloo")
            assert math.isfinite(seconds) and seconds > 0  # measured for real: something, and finite
            assert 0.0 <= share <= 1.0
            monkeypatch.setattr(comm_profile, "time", _ScriptedClock(both, alone, bare))
            seconds, _ = comm_profile._in_program(dist, coll, x, 1, 0, 0, None, work, "gloo")
            monkeypatch.undo()
            assert seconds == pytest.approx(expected / comm_profile._CHAIN)
    finally:
        dist.destroy_process_group()


# -- the whole-graph calibration -----------------------------------------------------------------
def test_the_whole_graph_runs_and_calibrates_the_ops(tmp_path):
    graph = gpt_graph()
    seconds = graph_seconds(graph)
    assert seconds > 0
    db = ProfileDB(tmp_path / "p.json")
    times, _ = profile_graph(graph, repeats=1, db_path=tmp_path / "p.json")
    factor, why = calibration(graph, times, db, "cpu")
    stored = json.loads((tmp_path / "p.json").read_text())["ops"]
    key = calibration_key(graph)
    assert math.isfinite(stored[key]["seconds"]) and stored[key]["seconds"] > 0
    # the factor is the stored whole-graph time over the ops' sum (its size on this machine is
    # bench/autodist.py's `compute_calibration`); one out of bounds is not used, and said
    ratio = stored[key]["seconds"] / sum(f + b for f, b in times.values())
    if 0.5 <= ratio <= 2.0:
        assert (factor, why) == (pytest.approx(ratio), None)
    else:
        assert factor == 1.0 and "outside" in why
    assert stored[key]["ops_seconds"] == pytest.approx(sum(f + b for f, b in times.values()))
    # cached: the stored factor is used, not measured again
    db.entries[key] = {"seconds": 1.5, "ops_seconds": 1.0}
    assert calibration(graph, times, db, "cpu") == (pytest.approx(1.5), None)


def test_a_factor_out_of_bounds_or_a_graph_that_cannot_run_is_not_calibrated(tmp_path):
    graph = gpt_graph()
    db = ProfileDB(tmp_path / "p.json")
    times = {1: (1e-3, 1e-3)}
    db.entries[calibration_key(graph)] = {"seconds": 1.0}
    factor, why = calibration(graph, times, db, "cpu")
    assert factor == 1.0 and "outside" in why
    db.entries[calibration_key(graph)] = {"error": "a traced branch on a tensor's value"}
    assert calibration(graph, times, db, "cpu") == (1.0, "a traced branch on a tensor's value")


def test_a_graph_with_a_branch_on_a_value_cannot_run_whole():
    graph = gpt_graph()
    graph.nodes[3].branch = [graph.nodes[2].id, True]
    with pytest.raises(RuntimeError, match="branch"):
        graph_seconds(graph)


def test_the_estimate_says_when_it_is_not_calibrated(tmp_path, monkeypatch):
    monkeypatch.setenv("NNSCALER_CACHE_DIR", str(tmp_path))
    graph = gpt_graph()
    graph.nodes[3].branch = [graph.nodes[2].id, True]
    cc = ComputeConfig(2, 2, pas_config={"_comm_profile": {"backend": "t", "collectives": LINE}, "_profile_repeats": 1})
    est = apply_policy(graph, cc, "autodist").autodist_plan.estimate
    assert est["compute_calibration"] == 1.0 and "branch" in est["not_calibrated"]


# -- the optimizer and ZeRO ----------------------------------------------------------------------
def test_the_optimizer_is_priced_per_element_and_per_tensor(tmp_path):
    db = ProfileDB(tmp_path / "p.json")
    per_tensor = optimizer_tensor_cost(db)
    per_element = optimizer_rate(db)
    assert per_tensor > 0 and per_element > 0
    # a tensor's dozen kernel calls cost more than one element's update
    assert per_tensor > 10 * per_element
    assert optimizer_tensor_cost(ProfileDB(tmp_path / "p.json")) == per_tensor  # cached


def test_the_optimizer_rate_is_measured_on_the_models_own_shapes(tmp_path):
    db = ProfileDB(tmp_path / "p.json")
    small = optimizer_rate(db, shapes=[(256, 64), (64,)] * 8)
    default = optimizer_rate(db)
    shapes = [k for k in db.entries if k.startswith("__optimizer_shape__:")]
    assert len(shapes) == 2 and small > 0 and default > 0  # one entry per distinct shape
    assert optimizer_rate(ProfileDB(tmp_path / "p.json"), shapes=[(256, 64), (64,)] * 8) == small  # cached
    # the same shapes, 4x as many tensors (a deeper model): the same rate, nothing measured
    deeper = ProfileDB(tmp_path / "p.json")
    assert optimizer_rate(deeper, shapes=[(256, 64), (64,)] * 32) == pytest.approx(small)
    assert not deeper.dirty and set(deeper.entries) == set(db.entries)
    # too large to measure on its own shapes: the default tensors' rate
    assert optimizer_rate(db, shapes=[(1 << 25,)]) == default


def _search(use_zero, tmp_path, monkeypatch):
    monkeypatch.setenv("NNSCALER_CACHE_DIR", str(tmp_path))
    # the optimizer's and the copies' measured rates held fixed: what is compared below is the
    # model's arithmetic, not how fast this machine happened to be (a loaded machine's slow
    # optimizer once made dp's step-level time exceed ZeRO's)
    import nnscaler.policies.autodist.policy as policy
    monkeypatch.setattr(policy, "optimizer_rate", lambda *a, **k: 1e-9)
    monkeypatch.setattr(policy, "optimizer_tensor_cost", lambda *a, **k: 1e-6)
    monkeypatch.setattr(policy, "memory_bandwidth", lambda *a, **k: 1e10)
    cc = ComputeConfig(1, 4, use_zero=use_zero,
                       pas_config={"_comm_profile": {"backend": "t", "collectives": LINE}, "_profile_repeats": 1})
    s = _Search(gpt_graph(), AutodistConfig.from_compute_config(cc))
    return s, s.problem(1, CommModel({"backend": "t", "collectives": LINE}))


def test_zero_prices_its_gather_and_copies_and_divides_the_optimizer(tmp_path, monkeypatch):
    s_dp, dp = _search(False, tmp_path, monkeypatch)
    s_z, zero = _search(True, tmp_path, monkeypatch)
    assert s_dp.copy_rate == 0.0 and s_z.copy_rate > 0
    pick = [0] * len(dp.ops)
    t_dp, m_dp = dp.evaluate(pick)
    t_z, m_z = zero.evaluate(pick)
    assert m_z < m_dp  # the optimizer state is sharded
    # the same compute; ZeRO adds a gather per bucket (latency 1e-4 s here), so it is not free
    assert t_z != t_dp
    assert zero.const_time > dp.const_time


def test_a_parameters_sync_and_update_are_marked_as_paid_once_a_step(tmp_path, monkeypatch):
    monkeypatch.setenv("NNSCALER_CACHE_DIR", str(tmp_path))

    def problem(runtime):
        cc = ComputeConfig(1, runtime, pas_config={"_comm_profile": {"backend": "t", "collectives": LINE},
                                                   "_profile_repeats": 1})
        s = _Search(gpt_graph(), AutodistConfig.from_compute_config(cc))
        return s.problem(1, CommModel({"backend": "t", "collectives": LINE})), s.scale
    (alone, scale_1), (dp, scale_4) = problem(1), problem(4)
    for p in (alone, dp):
        assert all(0.0 <= o <= t for op in p.ops for o, t in zip(op.once, op.time))
    # one device: the optimizer update only; 4 data-parallel units: the gradient sync besides
    once = lambda p, scale: sum(op.once[0] for op in p.ops) / scale  # noqa: E731
    assert 0.0 < once(alone, scale_1) < once(dp, scale_4)
    # what is not paid once is the same per micro-batch work (at each one's CPU sharing)
    per_micro = lambda p, scale: sum(op.time[0] - op.once[0] for op in p.ops) / scale  # noqa: E731
    assert per_micro(alone, scale_1) == pytest.approx(per_micro(dp, scale_4))
