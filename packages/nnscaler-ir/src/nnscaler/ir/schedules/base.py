"""The `Schedule` base class (per-device action lists, placement, validation); `Action` and the
schedule errors live in actions.py."""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from ..config import ConfigError
from .actions import Action, ScheduleDeadlockError, ScheduleError
from .timeline import simulate

__all__ = ["Action", "Schedule", "ScheduleError", "ScheduleDeadlockError"]


def _check_int(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {value}")
    return value


class Schedule:
    """Base class: a named set of per-device action lists plus a placement of stages.

    Subclasses set ``name`` / ``training`` and implement :meth:`_build` (one list of
    :class:`Action` per device, in execution order) and, where it differs from
    ``stage % ndevices``, :meth:`device_of`.
    """

    name: str = "schedule"
    training: bool = True

    def __init__(self, nstages: int, nmicros: int, ndevices: Optional[int] = None, *, backward_cost: int = 2):
        self.nstages = _check_int("nstages (pipeline_nstages)", nstages)
        self.nmicros = _check_int("nmicros (pipeline_nmicros)", nmicros)
        self.ndevices = _check_int("ndevices (pp_size)", nstages if ndevices is None else ndevices)
        self.backward_cost = _check_int("backward_cost", backward_cost)
        self._check()
        self._actions: List[List[Action]] = [list(a) for a in self._build()]
        self._timeline: Optional[List[List[Optional[Action]]]] = None

    # -- to override -----------------------------------------------------------------------
    def _check(self) -> None:
        """Refuse configurations the schedule cannot apply to (raise ConfigError)."""
        if self.ndevices != self.nstages:
            raise ConfigError(
                f"pipeline_scheduler={self.name!r} places one stage per device: ndevices (pp_size) must equal "
                f"nstages (pipeline_nstages); got ndevices={self.ndevices}, nstages={self.nstages}")

    def _build(self) -> List[List[Action]]:
        raise NotImplementedError

    def device_of(self, stage: int, micro: int = 0) -> int:
        """The device that runs ``stage`` (for ``micro``; only Chimera depends on it)."""
        return stage % self.ndevices

    def analytic_bubble(self) -> Optional[float]:
        """Closed-form bubble fraction under the module's cost model, or None if there is none."""
        p, m = self.ndevices, self.nmicros
        return (p - 1) / (m + p - 1)

    # -- queries ---------------------------------------------------------------------------
    def actions(self, device: int) -> List[Action]:
        """The actions of ``device`` in execution order (a copy)."""
        if not 0 <= device < self.ndevices:
            raise ValueError(f"device must be in [0, {self.ndevices}), got {device}")
        return list(self._actions[device])

    def cost(self, action: Action) -> int:
        return 1 if action.kind == "F" else self.backward_cost

    def deps(self, a: Action) -> List[Tuple[str, int, int]]:
        """(kind, stage, micro) of the actions `a` waits for."""
        if a.kind == "F":
            return [("F", a.stage - 1, a.micro)] if a.stage > 0 else []
        deps = [("F", a.stage, a.micro)]
        if a.stage < self.nstages - 1:
            deps.append(("B", a.stage + 1, a.micro))
        return deps

    def timeline(self) -> List[List[Optional[Action]]]:
        """Simulate the schedule; per device, one entry per time unit: the running Action or None.

        A backward occupies ``backward_cost`` consecutive slots. Raises ScheduleDeadlockError when
        at some time no device is running and none can start its next action.
        """
        if self._timeline is None:
            self._timeline = simulate(self)
        return [list(row) for row in self._timeline]

    def validate(self) -> "Schedule":
        """Check completeness, placement and absence of deadlock; returns self.

        Every (stage, micro) has exactly one F (and, when training, exactly one B), each on
        ``device_of(stage, micro)``; the simulated run completes.
        """
        if len(self._actions) != self.ndevices:
            raise ScheduleError(f"schedule {self.name!r} has {len(self._actions)} action lists for "
                                f"{self.ndevices} devices")
        seen: Dict[Tuple[str, int, int], int] = {}
        for d, acts in enumerate(self._actions):
            for a in acts:
                if not (0 <= a.stage < self.nstages and 0 <= a.micro < self.nmicros):
                    raise ScheduleError(f"schedule {self.name!r}: {a} on dev{d} is out of range "
                                        f"(nstages={self.nstages}, nmicros={self.nmicros})")
                if not self.training and a.kind == "B":
                    raise ScheduleError(f"inference schedule {self.name!r} has a backward action {a} on dev{d}")
                want = self.device_of(a.stage, a.micro)
                if want != d:
                    raise ScheduleError(f"schedule {self.name!r}: {a} is on dev{d} but stage {a.stage} "
                                        f"of micro-batch {a.micro} is placed on dev{want}")
                key = (a.kind, a.stage, a.micro)
                if key in seen:
                    raise ScheduleError(f"schedule {self.name!r}: {a} appears twice (dev{seen[key]}, dev{d})")
                seen[key] = d
        kinds = ("F", "B") if self.training else ("F",)
        missing = [f"{k}{m}@s{s}" for k in kinds for s in range(self.nstages) for m in range(self.nmicros)
                   if (k, s, m) not in seen]
        if missing:
            raise ScheduleError(f"schedule {self.name!r} misses actions: {', '.join(missing[:20])}"
                                + (" ..." if len(missing) > 20 else ""))
        self._timeline = None
        self.timeline()
        return self

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(nstages={self.nstages}, nmicros={self.nmicros}, "
                f"ndevices={self.ndevices}, backward_cost={self.backward_cost})")
