"""nnscaler.runtime.pipeline: pipeline-parallel schedules (pure Python, no torch.distributed).

A schedule lists, per pipeline device, the forward / backward steps (:class:`Action`) it runs in
order; it simulates itself in a unit-cost model (:meth:`Schedule.timeline`) to check itself
(:meth:`Schedule.validate`, which detects deadlocks); measuring and drawing timelines is
bench/schedule_report.py. Build one by its ``pipeline_scheduler`` name with :func:`get_schedule`. The schedules live in
``nnscaler.ir.schedules`` (policies validate them at plan time); the executor that runs one on
real stages is :mod:`nnscaler.runtime.pipeline.executor`.
"""
from nnscaler.ir.schedules import (INFERENCE_SCHEDULES, SCHEDULES, TRAINING_SCHEDULES, Action, ChimeraDirect,
                        ExplicitSchedule, GPipe, InferPipe, Interleaved1F1B, OneFOneB, OneFOneBPlus, Schedule,
                        ScheduleDeadlockError, ScheduleError, get_schedule)

__all__ = [
    "Action", "Schedule", "ExplicitSchedule", "GPipe", "OneFOneB", "OneFOneBPlus", "Interleaved1F1B",
    "ChimeraDirect", "InferPipe", "ScheduleError", "ScheduleDeadlockError", "get_schedule",
    "SCHEDULES", "TRAINING_SCHEDULES", "INFERENCE_SCHEDULES",
]
