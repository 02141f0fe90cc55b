"""PipelinePlan: how a staged graph runs as a pipeline (stages, micro-batches, schedule, devices).

A policy cuts the graph into ``nstages`` stages (``Node.stage``) and calls
``nnscaler.policies.schedule`` which stores a PipelinePlan on ``graph.pipeline``. The unit's
``plan_ngpus`` devices form ``pp_size`` *pipeline devices* of ``tp_size`` consecutive plan
devices each: pipeline device ``g`` is plan devices ``g*tp_size .. (g+1)*tp_size - 1``. Stage
``s`` of micro-batch ``m`` runs on pipeline device ``schedule.device_of(s, m)`` -- always
``s % pp_size`` except for Chimera, where odd micro-batches run on a second replica of the stage.
Inside a stage, op pieces use local indices ``0..tp_size-1`` (piece ``i`` on the ``i``-th plan
device of the pipeline device); the policy assigns them on the stage's *home* pipeline device
(the one of micro-batch 0).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import List, Tuple

from .config import ConfigError
from .schedules import Schedule, get_schedule

__all__ = ["PipelinePlan"]


@dataclass(frozen=True)
class PipelinePlan:
    nstages: int
    nmicros: int
    scheduler: str
    pp_size: int
    tp_size: int

    def __post_init__(self):
        if isinstance(self.tp_size, bool) or not isinstance(self.tp_size, int) or self.tp_size < 1:
            raise ConfigError(f"tp_size (plan devices per pipeline device, plan_ngpus // pp_size) must be an "
                              f"integer >= 1, got {self.tp_size!r}")
        self.schedule()  # validates: a schedule that cannot apply raises ConfigError here

    def schedule(self, backward_cost: int = 2) -> Schedule:
        """The validated schedule object (training or inference by the scheduler's name)."""
        return get_schedule(self.scheduler, self.nstages, self.nmicros, self.pp_size, backward_cost=backward_cost)

    @property
    def plan_ngpus(self) -> int:
        return self.pp_size * self.tp_size

    def group_devices(self, pipeline_device: int) -> Tuple[int, ...]:
        """The plan devices of pipeline device ``pipeline_device``."""
        return tuple(range(pipeline_device * self.tp_size, (pipeline_device + 1) * self.tp_size))

    def stage_groups(self, stage: int) -> List[int]:
        """The pipeline devices that hold (a replica of) ``stage``, home first."""
        sched = self.schedule()
        out: List[int] = []
        for m in range(min(self.nmicros, 2)):  # placement depends at most on the parity
            g = sched.device_of(stage, m)
            if g not in out:
                out.append(g)
        return out

    def home_devices(self, stage: int) -> Tuple[int, ...]:
        return self.group_devices(self.stage_groups(stage)[0])

    def stages_of(self, plan_device: int) -> List[Tuple[int, int]]:
        """(stage, local index) of every stage replica plan device ``plan_device`` runs."""
        g, i = divmod(plan_device, self.tp_size)
        return [(s, i) for s in range(self.nstages) if g in self.stage_groups(s)]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "PipelinePlan":
        try:
            return cls(**data)
        except TypeError as e:
            raise ConfigError(f"malformed pipeline plan {data!r}: {e}") from None
