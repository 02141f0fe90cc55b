"""The pipeline step time autodist estimates (nnscaler.policies.autodist.pipeline_time): the 1f1b
schedule played out with the stages' times, the messages' latency and shared CPU cores."""
from __future__ import annotations

import pytest

from nnscaler.policies.autodist.pipeline_time import PipelineTiming, step_seconds


@pytest.mark.parametrize("stages,micros", [(2, 1), (2, 4), (4, 4), (4, 8)])
def test_equal_stages_on_their_own_devices_take_the_textbook_time(stages, micros):
    f, b = 1.0, 2.0
    got = step_seconds([f] * stages, [b] * stages, micros)
    assert got == pytest.approx((micros + stages - 1) * (f + b))


def test_the_slowest_stage_sets_the_pace_and_the_fast_ones_do_not_add_up():
    even = step_seconds([1.0, 1.0], [2.0, 2.0], 8)
    uneven = step_seconds([0.5, 1.5], [1.0, 3.0], 8)  # same total work, one stage slower
    assert uneven > even
    assert uneven < (8 + 1) * 4.5  # below the textbook (m + s - 1) x slowest stage


def test_message_latency_lies_on_the_critical_path():
    f, b, lat = 1.0, 2.0, 0.25
    # one micro-batch through 2 stages: F0, message, F1, B1, message back, B0
    got = step_seconds([f, f], [b, b], 1, fwd_latency=[lat], bwd_latency=[lat])
    assert got == pytest.approx(2 * f + 2 * b + 2 * lat)
    assert step_seconds([f, f], [b, b], 4, fwd_latency=[lat], bwd_latency=[lat]) > step_seconds([f, f], [b, b], 4)


def test_shared_cores_slow_the_stages_that_run_together():
    f, b, m = 1.0, 2.0, 8
    alone = step_seconds([f, f], [b, b], m)
    one_core = step_seconds([f, f], [b, b], m, threads_per_stage=1, cores=1)
    work = 2 * m * (f + b)
    assert one_core == pytest.approx(work)  # one core: the step is all the work, one after the other
    assert alone < one_core
    assert step_seconds([f, f], [b, b], m, cores=1, contention=1.5) > one_core
    # the bubble is cheaper than a slot of the busy steady state: stages run alone there
    assert one_core < (m + 1) * 2 * (f + b)


def test_timing_divides_the_scale_out_of_the_stage_times():
    timing = PipelineTiming(fwd_share=1 / 3, scale=2.0, threads=4, cores=2)
    # 4 local processes on 2 cores, 2 stages of 2 processes: all busy = the priced stage times
    busy = timing.seconds([6.0, 6.0], [0.0], [0.0], 16)
    assert (16 + 1) * 6.0 * 0.85 < busy <= (16 + 1) * 6.0
    gpu = PipelineTiming(fwd_share=1 / 3)
    assert gpu.seconds([3.0, 3.0], [0.0], [0.0], 4) == pytest.approx(5 * 3.0)


def test_stages_running_together_slow_each_other_below_the_core_count():
    f, b, m = 1.0, 2.0, 8
    free = step_seconds([f, f], [b, b], m, threads_per_stage=1, cores=2)
    assert free == pytest.approx(step_seconds([f, f], [b, b], m))  # no contention measured: a device each
    slower = step_seconds([f, f], [b, b], m, threads_per_stage=1, cores=2, contention=1.2)
    # the steady state runs both stages (1.2x slower each); the bubble one alone, at its own speed
    assert free * 1.05 < slower < free * 1.2
