"""nnscaler.ir.pipeline_plan.PipelinePlan: placement of stages on devices, refusals, round trip.

Pure Python: a PipelinePlan only builds (and validates) a schedule object.
"""
from __future__ import annotations

import dataclasses
import json

import pytest

from nnscaler.ir.config import ConfigError
from nnscaler.ir.pipeline_plan import PipelinePlan


def _placement_from_schedule(plan: PipelinePlan) -> dict:
    """stage -> pipeline devices that run it for some micro-batch (home = micro-batch 0 first)."""
    sched = plan.schedule()
    out = {}
    for s in range(plan.nstages):
        groups = [sched.device_of(s, m) for m in range(plan.nmicros)]
        out[s] = list(dict.fromkeys(groups))
    return out


# -- placement -------------------------------------------------------------------------------

def test_1f1b_one_stage_per_pipeline_device_of_tp_devices():
    plan = PipelinePlan(4, 8, "1f1b", 4, 2)
    assert plan.plan_ngpus == 8
    assert [plan.group_devices(g) for g in range(4)] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert [plan.stage_groups(s) for s in range(4)] == [[0], [1], [2], [3]]
    assert plan.home_devices(2) == (4, 5)
    assert plan.stages_of(0) == [(0, 0)]
    assert plan.stages_of(5) == [(2, 1)]
    assert plan.stages_of(7) == [(3, 1)]


@pytest.mark.parametrize("scheduler", ["1f1b", "1f1b_plus", "gpipe", "infer_pipe"])
def test_single_stage_schedules_place_stage_s_on_device_s(scheduler):
    plan = PipelinePlan(3, 5, scheduler, 3, 1)
    assert [plan.home_devices(s) for s in range(3)] == [(0,), (1,), (2,)]
    assert [plan.stages_of(d) for d in range(3)] == [[(0, 0)], [(1, 0)], [(2, 0)]]


def test_interleaved_puts_stage_s_on_device_s_mod_pp():
    plan = PipelinePlan(4, 4, "1f1b_interleaved", 2, 1)
    assert [plan.stage_groups(s) for s in range(4)] == [[0], [1], [0], [1]]
    assert plan.home_devices(2) == (0,) and plan.home_devices(3) == (1,)
    assert plan.stages_of(0) == [(0, 0), (2, 0)]
    assert plan.stages_of(1) == [(1, 0), (3, 0)]


def test_interleaved_with_tensor_parallel_groups():
    plan = PipelinePlan(6, 6, "1f1b_interleaved", 3, 2)
    assert plan.plan_ngpus == 6
    assert plan.home_devices(4) == (2, 3)  # stage 4 -> pipeline device 1
    assert plan.stages_of(3) == [(1, 1), (4, 1)]
    assert plan.stages_of(4) == [(2, 0), (5, 0)]
    held = sorted(s for d in range(6) for s, i in plan.stages_of(d) if i == 0)
    assert held == list(range(6))  # every stage exactly once per local index


def test_chimera_places_two_replicas_in_opposite_directions():
    plan = PipelinePlan(4, 4, "chimera_direct", 4, 1)
    assert [plan.stage_groups(s) for s in range(4)] == [[0, 3], [1, 2], [2, 1], [3, 0]]
    assert [plan.home_devices(s) for s in range(4)] == [(0,), (1,), (2,), (3,)]  # home: micro-batch 0
    assert plan.stages_of(0) == [(0, 0), (3, 0)]
    assert plan.stages_of(1) == [(1, 0), (2, 0)]
    assert plan.stages_of(2) == [(1, 0), (2, 0)]
    assert plan.stages_of(3) == [(0, 0), (3, 0)]


def test_chimera_with_tensor_parallel_groups():
    plan = PipelinePlan(4, 2, "chimera_direct", 4, 2)
    assert plan.home_devices(1) == (2, 3)
    assert plan.group_devices(plan.stage_groups(1)[1]) == (4, 5)  # the up replica of stage 1
    assert plan.stages_of(7) == [(0, 1), (3, 1)]
    assert plan.stages_of(2) == [(1, 0), (2, 0)]


@pytest.mark.parametrize("args", [(4, 8, "1f1b", 4, 1), (2, 3, "gpipe", 2, 2), (4, 4, "1f1b_interleaved", 2, 1),
                                  (6, 3, "1f1b_interleaved", 3, 1), (4, 6, "chimera_direct", 4, 1),
                                  (3, 2, "infer_pipe", 3, 4), (5, 7, "1f1b_plus", 5, 1)])
def test_stage_groups_agree_with_the_schedule_for_every_micro_batch(args):
    plan = PipelinePlan(*args)
    assert {s: plan.stage_groups(s) for s in range(plan.nstages)} == _placement_from_schedule(plan)
    for d in range(plan.plan_ngpus):  # stages_of is the inverse of stage_groups
        g, i = divmod(d, plan.tp_size)
        assert plan.stages_of(d) == [(s, i) for s in range(plan.nstages) if g in plan.stage_groups(s)]
        assert d in plan.group_devices(g)


def test_single_stage_pipeline_with_one_micro_batch():
    plan = PipelinePlan(1, 1, "1f1b", 1, 3)
    assert plan.stage_groups(0) == [0]
    assert plan.home_devices(0) == (0, 1, 2)
    assert [plan.stages_of(d) for d in range(3)] == [[(0, 0)], [(0, 1)], [(0, 2)]]


def test_schedule_object_is_validated_and_named():
    plan = PipelinePlan(4, 8, "1f1b_interleaved", 2, 1)
    sched = plan.schedule()
    assert sched.name == "1f1b_interleaved" and sched.training
    assert (sched.nstages, sched.nmicros, sched.ndevices) == (4, 8, 2)
    assert plan.schedule(backward_cost=3).backward_cost == 3
    assert not PipelinePlan(2, 2, "infer_pipe", 2, 1).schedule().training


def test_plan_is_frozen_and_hashable():
    plan = PipelinePlan(2, 4, "1f1b", 2, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.nmicros = 8
    assert plan == PipelinePlan(2, 4, "1f1b", 2, 1)
    assert len({plan, PipelinePlan(2, 4, "1f1b", 2, 1)}) == 1


# -- refusals --------------------------------------------------------------------------------

@pytest.mark.parametrize("args,match", [
    ((4, 4, "pipedream", 4, 1), r"unknown pipeline_scheduler 'pipedream'; valid: training .*'1f1b'"),
    ((4, 4, None, 4, 1), r"unknown pipeline_scheduler None"),
    ((4, 4, "1f1b", 2, 1), r"'1f1b' places one stage per device: ndevices \(pp_size\) must equal nstages "
                           r"\(pipeline_nstages\); got ndevices=2, nstages=4"),
    ((2, 4, "gpipe", 4, 1), r"ndevices \(pp_size\) must equal nstages \(pipeline_nstages\)"),
    ((3, 4, "infer_pipe", 1, 1), r"ndevices \(pp_size\) must equal nstages"),
    ((5, 4, "1f1b_interleaved", 2, 1), r"needs nstages \(pipeline_nstages\) to be a multiple of ndevices "
                                       r"\(pp_size\).*nstages=5, ndevices=2"),
    ((4, 3, "1f1b_interleaved", 2, 1), r"needs nmicros \(pipeline_nmicros\) to be a multiple of ndevices "
                                       r"\(pp_size\).*nmicros=3"),
    ((2, 4, "chimera_direct", 2, 1), r"'chimera_direct' needs nstages \(pipeline_nstages\) == 4"),
    ((4, 4, "chimera_direct", 2, 1), r"'chimera_direct' needs ndevices \(pp_size\) == 4"),
    ((4, 3, "chimera_direct", 4, 1), r"'chimera_direct' needs an even nmicros \(pipeline_nmicros\)"),
])
def test_refused_schedule_combinations_name_the_parameter(args, match):
    with pytest.raises(ConfigError, match=match):
        PipelinePlan(*args)


@pytest.mark.parametrize("field,value,match", [
    ("nstages", 0, r"nstages \(pipeline_nstages\) must be >= 1, got 0"),
    ("nstages", "4", r"nstages \(pipeline_nstages\) must be an integer >= 1, got '4'"),
    ("nmicros", 0, r"nmicros \(pipeline_nmicros\) must be >= 1"),
    ("nmicros", True, r"nmicros \(pipeline_nmicros\) must be an integer >= 1, got True"),
    ("nmicros", 2.0, r"nmicros \(pipeline_nmicros\) must be an integer"),
    ("pp_size", 0, r"ndevices \(pp_size\) must be >= 1"),
    ("tp_size", 0, r"tp_size .* must be an integer >= 1, got 0"),
    ("tp_size", -2, r"tp_size .* must be an integer >= 1, got -2"),
    ("tp_size", "2", r"tp_size .* must be an integer >= 1, got '2'"),
    ("tp_size", True, r"tp_size .* must be an integer >= 1, got True"),
])
def test_bad_values_name_the_field(field, value, match):
    args = dict(nstages=2, nmicros=4, scheduler="1f1b", pp_size=2, tp_size=1)
    args[field] = value
    with pytest.raises(ConfigError, match=match):
        PipelinePlan(**args)


# -- serialisation ---------------------------------------------------------------------------

@pytest.mark.parametrize("args", [(4, 8, "1f1b", 4, 2), (4, 4, "1f1b_interleaved", 2, 1),
                                  (4, 2, "chimera_direct", 4, 1), (2, 3, "infer_pipe", 2, 1)])
def test_dict_round_trip_through_json(args):
    plan = PipelinePlan(*args)
    data = plan.to_dict()
    assert data == dict(zip(("nstages", "nmicros", "scheduler", "pp_size", "tp_size"), args))
    back = PipelinePlan.from_dict(json.loads(json.dumps(data)))
    assert back == plan
    assert [back.stage_groups(s) for s in range(back.nstages)] == [plan.stage_groups(s) for s in range(plan.nstages)]


@pytest.mark.parametrize("data", [
    {"nstages": 2, "nmicros": 4, "scheduler": "1f1b", "pp_size": 2},  # no tp_size
    {"nstages": 2, "nmicros": 4, "scheduler": "1f1b", "pp_size": 2, "tp_size": 1, "extra": 0},
    None,
    [2, 4, "1f1b", 2, 1],
])
def test_from_dict_refuses_malformed_data(data):
    with pytest.raises(ConfigError, match="malformed pipeline plan"):
        PipelinePlan.from_dict(data)


def test_from_dict_revalidates_the_schedule():
    data = PipelinePlan(4, 4, "chimera_direct", 4, 1).to_dict()
    data["nmicros"] = 5
    with pytest.raises(ConfigError, match=r"even nmicros \(pipeline_nmicros\)"):
        PipelinePlan.from_dict(data)
    data = dict(data, nmicros=4, tp_size=0)
    with pytest.raises(ConfigError, match="tp_size"):
        PipelinePlan.from_dict(data)
