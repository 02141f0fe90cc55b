"""Measuring and drawing pipeline schedules on the unit-cost model of nnscaler.ir.schedules
(forward 1 unit, backward `backward_cost`): what bench/pipeline.py and the schedule tests compare
against. The library itself only simulates to refuse a schedule that deadlocks."""
from __future__ import annotations

from nnscaler.ir.schedules import Action, ChimeraDirect, Schedule

__all__ = ["makespan", "bubble_fraction", "peak_inflight", "render"]


def makespan(schedule: Schedule) -> int:
    """Length of the simulated timeline, in time units."""
    return len(schedule.timeline()[0])


def bubble_fraction(schedule: Schedule) -> float:
    """Idle device-time over total device-time, measured from the simulated timeline."""
    tl = schedule.timeline()
    total = sum(len(row) for row in tl)
    idle = sum(1 for row in tl for slot in row if slot is None)
    return idle / total


def peak_inflight(schedule: Schedule, device: int) -> int:
    """Most (stage, micro-batch) activations held at once on `device`: forwards run whose backward
    has not finished yet (the activation-memory proxy). Counted in stage activations: with several
    stages per device (interleaved: ``v`` chunks, Chimera: 2) each is a fraction of the device's
    layers, so compare in layers, not in counts. Inference holds none beyond the running forward,
    so it reports 1."""
    actions = schedule.actions(device)
    if not schedule.training:
        return 1 if actions else 0
    cur = peak = 0
    for a in actions:
        cur += 1 if a.kind == "F" else -1
        peak = max(peak, cur)
    return peak


def _token(schedule: Schedule, a: Action) -> str:
    stages_per_dev = schedule.nstages // schedule.ndevices if schedule.name != ChimeraDirect.name else 1
    return f"{a.kind}{a.micro}" + (f"s{a.stage}" if stages_per_dev > 1 else "")


def render(schedule: Schedule) -> str:
    """The simulated timeline as text, one line per device, one column per time unit.

    ``F3`` is the forward of micro-batch 3, ``B3`` its backward (repeated over each unit it
    occupies), ``.`` is idle; with several stages per device the stage is appended (``F3s5``),
    except for Chimera where the micro-batch's parity already names the stage (even: down
    replica, stage ``d``; odd: up replica, stage ``3 - d``).
    """
    toks = [[_token(schedule, a) if a is not None else "." for a in row] for row in schedule.timeline()]
    width = max((len(t) for row in toks for t in row), default=1)
    return "\n".join(f"dev{d}: " + " ".join(t.ljust(width) for t in row).rstrip() for d, row in enumerate(toks))
