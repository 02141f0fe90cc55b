"""nnscaler.ir.schedules: completeness, timelines, bubbles, memory, refusals.

Pure Python, no processes. Cost model (see schedules.py): F = 1 time unit, B = backward_cost
units (default 2); communication is free.
"""
from __future__ import annotations

from fractions import Fraction

import os
import sys

import pytest

from nnscaler.ir.config import ConfigError
from nnscaler.ir.schedules import (SCHEDULES, Action, ChimeraDirect, ExplicitSchedule, GPipe, InferPipe,
                                       Interleaved1F1B, OneFOneB, OneFOneBPlus, ScheduleDeadlockError,
                                       ScheduleError, get_schedule)



def _bench_module(name):
    """A bench/ script as a module, loaded by path: bench/ never goes on sys.path, where its file
    names would shadow modules of the same name for every later test."""
    import importlib.util
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"nnscaler_bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_report = _bench_module("schedule_report")  # bench-side measures
bubble_fraction, makespan, peak_inflight, render = (_report.bubble_fraction, _report.makespan, _report.peak_inflight,
                                                    _report.render)

GRID = [(p, m) for p in (1, 2, 3, 4, 5, 8) for m in (1, 2, 3, 4, 7, 8, 16)]


def _exact(x: float) -> Fraction:
    return Fraction(x).limit_denominator(10_000)


def _counts_ok(s):
    seen = [(a.kind, a.stage, a.micro) for d in range(s.ndevices) for a in s.actions(d)]
    kinds = "FB" if s.training else "F"
    assert sorted(seen) == sorted((k, st, m) for k in kinds for st in range(s.nstages) for m in range(s.nmicros))


# -- validate over a grid ------------------------------------------------------------------

@pytest.mark.parametrize("cls", [GPipe, OneFOneB, OneFOneBPlus, InferPipe])
@pytest.mark.parametrize("p,m", GRID)
@pytest.mark.parametrize("b", [1, 2, 3])
def test_single_stage_per_device_schedules_validate(cls, p, m, b):
    s = cls(p, m, backward_cost=b).validate()
    _counts_ok(s)
    busy = m * (1 + (b if s.training else 0))
    assert all(sum(1 for x in row if x is not None) == busy for row in s.timeline())


@pytest.mark.parametrize("ndev", [1, 2, 3, 4])
@pytest.mark.parametrize("v", [1, 2, 3])
@pytest.mark.parametrize("groups", [1, 2, 3])
@pytest.mark.parametrize("b", [1, 2])
def test_interleaved_validates(ndev, v, groups, b):
    s = Interleaved1F1B(v * ndev, groups * ndev, ndev, backward_cost=b).validate()
    _counts_ok(s)
    assert all(s.device_of(a.stage) == d for d in range(ndev) for a in s.actions(d))


@pytest.mark.parametrize("m", [2, 4, 6, 8, 16])
@pytest.mark.parametrize("b", [1, 2, 3])
def test_chimera_validates(m, b):
    s = ChimeraDirect(4, m, backward_cost=b).validate()
    _counts_ok(s)
    # each device holds the down replica's stage d (even micros) and the up replica's stage 3-d
    for d in range(4):
        assert {(a.stage, a.micro % 2) for a in s.actions(d)} <= {(d, 0), (3 - d, 1)}


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_registry_builds_every_schedule(name):
    s = get_schedule(name, 4, 8)
    assert s.name == name and type(s) is SCHEDULES[name]
    assert s.ndevices == (2 if name == "1f1b_interleaved" else 4)


# -- timelines (p=4, m=8, B=2F) ------------------------------------------------------------

ONE_F_ONE_B_4x8 = """\
dev0: F0 F1 F2 F3 .  .  .  .  .  .  B0 B0 F4 B1 B1 F5 B2 B2 F6 B3 B3 F7 B4 B4 .  B5 B5 .  B6 B6 .  B7 B7
dev1: .  F0 F1 F2 .  .  .  .  B0 B0 F3 B1 B1 F4 B2 B2 F5 B3 B3 F6 B4 B4 F7 B5 B5 .  B6 B6 .  B7 B7 .  .
dev2: .  .  F0 F1 .  .  B0 B0 F2 B1 B1 F3 B2 B2 F4 B3 B3 F5 B4 B4 F6 B5 B5 F7 B6 B6 .  B7 B7 .  .  .  .
dev3: .  .  .  F0 B0 B0 F1 B1 B1 F2 B2 B2 F3 B3 B3 F4 B4 B4 F5 B5 B5 F6 B6 B6 F7 B7 B7 .  .  .  .  .  ."""

GPIPE_4x8 = """\
dev0: F0 F1 F2 F3 F4 F5 F6 F7 .  .  .  .  .  .  .  .  .  B0 B0 B1 B1 B2 B2 B3 B3 B4 B4 B5 B5 B6 B6 B7 B7
dev1: .  F0 F1 F2 F3 F4 F5 F6 F7 .  .  .  .  .  .  B0 B0 B1 B1 B2 B2 B3 B3 B4 B4 B5 B5 B6 B6 B7 B7 .  .
dev2: .  .  F0 F1 F2 F3 F4 F5 F6 F7 .  .  .  B0 B0 B1 B1 B2 B2 B3 B3 B4 B4 B5 B5 B6 B6 B7 B7 .  .  .  .
dev3: .  .  .  F0 F1 F2 F3 F4 F5 F6 F7 B0 B0 B1 B1 B2 B2 B3 B3 B4 B4 B5 B5 B6 B6 B7 B7 .  .  .  .  .  ."""

ONE_F_ONE_B_4x4_UNIT = """\
dev0: F0 F1 F2 F3 .  .  .  B0 .  B1 .  B2 .  B3
dev1: .  F0 F1 F2 .  .  B0 F3 B1 .  B2 .  B3 .
dev2: .  .  F0 F1 .  B0 F2 B1 F3 B2 .  B3 .  .
dev3: .  .  .  F0 B0 F1 B1 F2 B2 F3 B3 .  .  ."""

INFER_4x4 = """\
dev0: F0 F1 F2 F3 .  .  .
dev1: .  F0 F1 F2 F3 .  .
dev2: .  .  F0 F1 F2 F3 .
dev3: .  .  .  F0 F1 F2 F3"""


def test_1f1b_timeline():
    s = get_schedule("1f1b", 4, 8)
    print(render(s))
    assert render(s) == ONE_F_ONE_B_4x8
    assert render(get_schedule("1f1b", 4, 4, backward_cost=1)) == ONE_F_ONE_B_4x4_UNIT


def test_gpipe_timeline():
    assert render(get_schedule("gpipe", 4, 8)) == GPIPE_4x8


def test_infer_pipe_timeline():
    assert render(get_schedule("infer_pipe", 4, 4)) == INFER_4x4


def test_1f1b_action_order():
    s = OneFOneB(4, 8)
    assert [str(a) for a in s.actions(3)[:4]] == ["F0@s3", "B0@s3", "F1@s3", "B1@s3"]
    kinds0 = "".join(a.kind for a in s.actions(0))
    assert kinds0 == "FFF" + "FB" * 5 + "BBB"


def test_interleaved_timeline_shows_stages():
    s = get_schedule("1f1b_interleaved", 8, 8, ndevices=4)
    out = render(s)
    print(out)
    first = out.splitlines()[0].split()
    assert first[:9] == ["dev0:", "F0s0", "F1s0", "F2s0", "F3s0", "F0s4", "F1s4", "F2s4", "F3s4"]


# -- bubbles -------------------------------------------------------------------------------

@pytest.mark.parametrize("cls", [GPipe, OneFOneB, OneFOneBPlus])
@pytest.mark.parametrize("p,m", GRID)
@pytest.mark.parametrize("b", [1, 2, 3])
def test_bubble_matches_analytic(cls, p, m, b):
    s = cls(p, m, backward_cost=b)
    assert _exact(bubble_fraction(s)) == Fraction(p - 1, m + p - 1)
    assert _exact(s.analytic_bubble()) == Fraction(p - 1, m + p - 1)
    assert makespan(s) == (m + p - 1) * (1 + b)


@pytest.mark.parametrize("p,m", GRID)
def test_infer_bubble(p, m):
    s = InferPipe(p, m)
    assert _exact(bubble_fraction(s)) == _exact(s.analytic_bubble()) == Fraction(p - 1, m + p - 1)


@pytest.mark.parametrize("p,m,v", [(4, 8, 2), (4, 16, 2), (2, 4, 2), (4, 8, 4), (3, 6, 3)])
def test_interleaved_bubble_smaller_than_1f1b(p, m, v):
    inter = Interleaved1F1B(v * p, m, p)
    plain = OneFOneB(p, m)
    assert bubble_fraction(inter) < bubble_fraction(plain)
    assert _exact(inter.analytic_bubble()) == Fraction(p - 1, v * m + p - 1)


def test_interleaved_bubble_4x8_v2_matches_megatron():
    s = Interleaved1F1B(8, 8, 4)
    assert _exact(bubble_fraction(s)) == Fraction(3, 19) == _exact(s.analytic_bubble())


def test_chimera_bubble_smaller_than_1f1b():
    for m in (2, 4, 8, 16):
        assert bubble_fraction(ChimeraDirect(4, m)) < bubble_fraction(OneFOneB(4, m))
    assert ChimeraDirect(4, 8).analytic_bubble() is None


# -- memory --------------------------------------------------------------------------------

@pytest.mark.parametrize("p,m", GRID)
def test_peak_inflight(p, m):
    g, o, plus = GPipe(p, m), OneFOneB(p, m), OneFOneBPlus(p, m)
    for s in range(p):
        assert peak_inflight(g, s) == m
        assert peak_inflight(o, s) == min(p - s, m)
        want_plus = min(p - s + 1, m) if s < p - 1 else 1
        assert peak_inflight(plus, s) == want_plus
    assert all(peak_inflight(InferPipe(p, m), d) == 1 for d in range(p))


def test_chimera_memory_balanced():
    s = ChimeraDirect(4, 8)
    assert [peak_inflight(s, d) for d in range(4)] == [4, 5, 5, 4]


# -- refusals ------------------------------------------------------------------------------

@pytest.mark.parametrize("args,kwargs,needles", [
    (("pipedream", 4, 8), {}, ["unknown pipeline_scheduler", "'1f1b'", "'infer_pipe'"]),
    (("1f1b", 4, 0), {}, ["nmicros", "pipeline_nmicros", ">= 1"]),
    (("1f1b", 0, 4), {}, ["nstages", "pipeline_nstages", ">= 1"]),
    (("1f1b", 4, 2.0), {}, ["nmicros", "integer"]),
    (("gpipe", 4, 8, 2), {}, ["ndevices", "pp_size", "must equal"]),
    (("chimera_direct", 3, 8), {}, ["chimera_direct", "nstages", "== 4", "got nstages=3"]),
    (("chimera_direct", 4, 7), {}, ["chimera_direct", "even nmicros", "got nmicros=7"]),
    (("chimera_direct", 4, 8, 2), {}, ["chimera_direct", "ndevices", "== 4"]),
    (("1f1b_interleaved", 8, 6, 4), {}, ["nmicros", "multiple of", "ndevices", "got nmicros=6"]),
    (("1f1b_interleaved", 6, 8, 4), {}, ["nstages", "multiple of", "ndevices"]),
    (("1f1b_interleaved", 5, 8), {}, ["nstages", "must be even", "got nstages=5"]),
    (("infer_pipe", 4, 8), {"training": True}, ["inference schedule", "training"]),
    (("1f1b", 4, 8), {"training": False}, ["training schedule", "infer_pipe"]),
    (("1f1b", 4, 8), {"backward_cost": 0}, ["backward_cost", ">= 1"]),
])
def test_refused_configurations(args, kwargs, needles):
    with pytest.raises(ConfigError) as e:
        get_schedule(*args, **kwargs)
    assert isinstance(e.value, ValueError)
    for n in needles:
        assert n in str(e.value), (n, str(e.value))


def test_training_flag_accepts_matching_kind():
    assert get_schedule("1f1b", 2, 2, training=True).training
    assert not get_schedule("infer_pipe", 2, 2, training=False).training


# -- broken schedules ------------------------------------------------------------------------

def test_deadlock_detected():
    # stage 0 waits for B0 of stage 1 before running F1, while stage 1 wants F1 before its B0
    acts = [
        [Action("F", 0, 0), Action("B", 0, 0), Action("F", 0, 1), Action("B", 0, 1)],
        [Action("F", 1, 0), Action("F", 1, 1), Action("B", 1, 0), Action("B", 1, 1)],
    ]
    s = ExplicitSchedule("broken", 2, 2, acts)
    with pytest.raises(ScheduleDeadlockError) as e:
        s.validate()
    msg = str(e.value)
    assert "deadlocks" in msg and "dev0: waits at B0@s0" in msg and "dev1: waits at F1@s1" in msg
    assert "dev1: F0@s1 F1@s1 B0@s1 B1@s1" in msg  # the action lists are shown
    with pytest.raises(ScheduleDeadlockError):
        render(s)


def test_backward_before_forward_deadlocks():
    acts = [[Action("B", 0, 0), Action("F", 0, 0)]]
    with pytest.raises(ScheduleDeadlockError):
        ExplicitSchedule("bw-first", 1, 1, acts).validate()


def test_missing_duplicate_and_misplaced_actions():
    good = OneFOneB(2, 2)
    lists = [good.actions(0), good.actions(1)]
    with pytest.raises(ScheduleError, match="misses actions: B1@s1"):
        ExplicitSchedule("x", 2, 2, [lists[0], lists[1][:-1]]).validate()
    with pytest.raises(ScheduleError, match="appears twice"):
        ExplicitSchedule("x", 2, 2, [lists[0] + [Action("F", 0, 0)], lists[1]]).validate()
    with pytest.raises(ScheduleError, match="placed on dev1"):
        ExplicitSchedule("x", 2, 2, [lists[0] + [Action("F", 1, 0)], lists[1][1:]]).validate()
    with pytest.raises(ScheduleError, match="out of range"):
        ExplicitSchedule("x", 2, 2, [lists[0] + [Action("F", 0, 5)], lists[1]]).validate()
    with pytest.raises(ScheduleError, match="backward action"):
        ExplicitSchedule("x", 2, 2, lists, training=False).validate()
    with pytest.raises(ScheduleError, match="'F'"):
        Action("W", 0, 0)


def test_explicit_schedule_equal_to_builtin_runs_the_same():
    ref = OneFOneB(4, 8)
    again = ExplicitSchedule("copy", 4, 8, [ref.actions(d) for d in range(4)]).validate()
    assert render(again) == render(ref)
