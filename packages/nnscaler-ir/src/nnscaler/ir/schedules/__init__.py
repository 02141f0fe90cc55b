"""Pipeline schedules as small, pure-Python objects (no torch, no torch.distributed).

A schedule says, for every pipeline device, which forward (``F``) and backward (``B``) steps it
runs and in which order. A *stage* is one piece of the model; a *device* is one pipeline rank
(one ``pp`` position; it may itself hold several GPUs for tensor / data parallelism). Stage ``s``
of micro-batch ``m`` is written ``F(s, m)`` / ``B(s, m)``.

Dependencies (the only ones the simulation knows; communication is free and instantaneous):

* ``F(s, m)`` runs after ``F(s-1, m)`` has finished;
* ``B(s, m)`` runs after ``F(s, m)`` and after ``B(s+1, m)`` have finished
  (the last stage's backward needs only its own forward: the loss is computed there);
* a device runs its actions strictly in its list order, one at a time.

Cost model (used by :meth:`Schedule.timeline`, nnscaler.ir.schedule_timeline): discrete time,
every forward costs 1 unit, every backward ``backward_cost`` units (default 2, i.e. ``B = 2F``,
the usual ratio for transformer layers; any positive integer is accepted). Under this model
GPipe and 1F1B on ``p`` stages and ``m`` micro-batches both last ``(m + p - 1) * (1 + b)`` units
while each device is busy ``m * (1 + b)``, so their bubble is exactly ``(p - 1) / (m + p - 1)``
for *any* backward cost ``b`` -- that is :meth:`Schedule.analytic_bubble`.

Schedules (names are the ``pipeline_scheduler`` values of the ``pp`` / ``hybrid`` policies):

=====================  =====================================================================
``gpipe``              all forwards, then all backwards (backwards in micro-batch order).
``1f1b``               warm-up ``p-1-s`` forwards on stage ``s``, steady one-forward-one-
                       backward, cool-down backwards. Peak in-flight micro-batches ``p - s``.
``1f1b_plus``          1F1B with one more warm-up forward per stage (``p - s`` instead of
                       ``p-1-s``, capped at ``m``): each device keeps one extra activation so a
                       late backward from the next stage never leaves it idle when it could
                       already run the next forward. Peak in-flight ``min(p - s + 1, m)``.
                       Same bubble as 1F1B in the zero-latency model when the last stage
                       keeps 1F1B's order (it does: its warm-up stays 0, see the class).
``1f1b_interleaved``   Megatron-LM's interleaved 1F1B: ``v`` model chunks per device,
                       ``nstages = v * ndevices``, stage ``s`` on device ``s % ndevices``;
                       requires ``nmicros % ndevices == 0``.
``chimera_direct``     two replicas of a 4-stage pipeline in opposite directions (see class).
``infer_pipe``         inference: forwards only, micro-batches in order.
=====================  =====================================================================

Use :func:`get_schedule` to build one by name. The library simulates a schedule only to refuse one
that deadlocks (`Schedule.validate`, nnscaler/ir/schedule_timeline.py); measuring and drawing
timelines (bubble fraction, peak activations, text rendering) is for benchmarks and tests:
bench/schedule_report.py.
"""
from __future__ import annotations

from typing import Optional

from ..config import ConfigError
from .base import Action, Schedule, ScheduleDeadlockError, ScheduleError, _check_int
from .kinds import ChimeraDirect, ExplicitSchedule, GPipe, InferPipe, Interleaved1F1B, OneFOneB, OneFOneBPlus

__all__ = [
    "Action", "Schedule", "ExplicitSchedule", "GPipe", "OneFOneB", "OneFOneBPlus", "Interleaved1F1B",
    "ChimeraDirect", "InferPipe", "ScheduleError", "ScheduleDeadlockError", "get_schedule",
    "SCHEDULES", "TRAINING_SCHEDULES", "INFERENCE_SCHEDULES",
]

TRAINING_SCHEDULES = {c.name: c for c in (OneFOneB, OneFOneBPlus, Interleaved1F1B, GPipe, ChimeraDirect)}
INFERENCE_SCHEDULES = {c.name: c for c in (InferPipe,)}
SCHEDULES = {**TRAINING_SCHEDULES, **INFERENCE_SCHEDULES}


def get_schedule(name: str, nstages: int, nmicros: int, ndevices: Optional[int] = None, *,
                 training: Optional[bool] = None, backward_cost: int = 2) -> Schedule:
    """Build the schedule called ``name`` (a ``pipeline_scheduler`` value) and validate it.

    ``ndevices`` (``pp_size``) defaults to ``nstages``, except for ``1f1b_interleaved`` where it
    defaults to ``nstages // 2`` (two stages per device). ``training=True`` refuses inference
    schedules, ``training=False`` refuses training schedules, None accepts both.
    Raises ConfigError (a ValueError) naming the parameter and the rule it breaks.
    """
    if not isinstance(name, str) or name not in SCHEDULES:
        raise ConfigError(f"unknown pipeline_scheduler {name!r}; valid: training "
                          f"{sorted(TRAINING_SCHEDULES)}, inference {sorted(INFERENCE_SCHEDULES)}")
    if training is True and name in INFERENCE_SCHEDULES:
        raise ConfigError(f"pipeline_scheduler={name!r} is an inference schedule (forward only) but a training "
                          f"schedule is needed; use one of {sorted(TRAINING_SCHEDULES)}")
    if training is False and name in TRAINING_SCHEDULES:
        raise ConfigError(f"pipeline_scheduler={name!r} is a training schedule but inference has no backward; "
                          f"use one of {sorted(INFERENCE_SCHEDULES)}")
    _check_int("nstages (pipeline_nstages)", nstages)
    _check_int("nmicros (pipeline_nmicros)", nmicros)
    if ndevices is None and name == Interleaved1F1B.name:
        if nstages % 2:
            raise ConfigError(f"pipeline_scheduler='1f1b_interleaved' without ndevices (pp_size) puts 2 stages "
                              f"per device, so nstages (pipeline_nstages) must be even; got nstages={nstages}")
        ndevices = nstages // 2
    return SCHEDULES[name](nstages, nmicros, ndevices, backward_cost=backward_cost).validate()
