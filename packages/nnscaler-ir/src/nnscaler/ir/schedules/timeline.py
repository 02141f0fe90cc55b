"""Simulating a schedule on the unit-cost model: what `Schedule.validate` uses to refuse a
schedule that deadlocks. Measuring and drawing timelines is bench/schedule_report.py."""
from __future__ import annotations

from typing import Dict, List, Optional, Protocol, Tuple

from .actions import Action, ScheduleDeadlockError


class Schedule(Protocol):
    """What the simulation reads of a `nnscaler.ir.schedules.Schedule`."""

    ndevices: int

    def actions(self, device: int) -> List[Action]: ...

    def deps(self, a: Action) -> List[Tuple[str, int, int]]: ...

    def cost(self, action: Action) -> int: ...

__all__ = ["simulate"]


def simulate(schedule: Schedule) -> List[List[Optional[Action]]]:
    """Per device, one entry per time unit: the running Action or None (unit-cost model of
    nnscaler.ir.schedules); raises ScheduleDeadlockError when no device can run its next action."""
    D = schedule.ndevices
    lists = [schedule.actions(d) for d in range(schedule.ndevices)]
    ptr = [0] * D
    running: List[Optional[Action]] = [None] * D
    busy_until = [0] * D
    done: Dict[Tuple[str, int, int], int] = {}
    slots: List[List[Optional[Action]]] = [[] for _ in range(D)]
    t = 0
    while any(ptr[d] < len(lists[d]) for d in range(D)) or any(r is not None for r in running):
        for d in range(D):
            if running[d] is not None and busy_until[d] == t:
                a = running[d]
                done[(a.kind, a.stage, a.micro)] = t
                running[d] = None
        if all(ptr[d] == len(lists[d]) and running[d] is None for d in range(D)):
            break
        for d in range(D):
            if running[d] is None and ptr[d] < len(lists[d]):
                a = lists[d][ptr[d]]
                if all(dep in done for dep in schedule.deps(a)):
                    running[d] = a
                    busy_until[d] = t + schedule.cost(a)
                    ptr[d] += 1
        if all(r is None for r in running):
            waiting = "\n".join(
                f"  dev{d}: waits at {lists[d][ptr[d]]} for "
                f"{[f'{k}{m}@s{s}' for (k, s, m) in schedule.deps(lists[d][ptr[d]]) if (k, s, m) not in done]}"
                for d in range(D) if ptr[d] < len(lists[d]))
            orders = "\n".join(f"  dev{d}: " + " ".join(str(a) for a in lists[d]) for d in range(D))
            raise ScheduleDeadlockError(
                f"schedule {schedule.name!r} deadlocks at time {t} (no device can run its next action):\n"
                f"{waiting}\naction lists:\n{orders}")
        for d in range(D):
            slots[d].append(running[d])
        t += 1
    return slots
