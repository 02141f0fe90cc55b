"""Communication time per collective and group size, from measurements.

A profile is ``{"backend": ..., "format": 6, "collectives": {name: {key: entry}}}``, the key a
group size ``"n"`` (measured alone) or ``"n/P"`` (n in a job of P local processes, P / n groups
at once: `profile_key`), where an
entry is ``[latency_s, bytes_per_s]`` (a straight line: ``latency + wire / bandwidth``) or
``[latency_s, bytes_per_s, [[wire, seconds], ...], cpu_share]`` with the measured points and the
share of a collective's time its process spends on a CPU (gloo's threads copying, reducing and
handing messages over). Bytes are the
ring algorithm's wire bytes per rank (`nnscaler.ir.COST_MODELS["ring"]`). With points, a time
is read off the measured curve (linear between points, the last segment's slope beyond the
largest): gloo's time is not one line over four decades of sizes (a fitted line missed a 4 MB
all-reduce by 40 %, bench/autodist.py). `comm_profile.measure` takes the points on real local
processes; group sizes not measured are priced with the nearest measured size.

Measured beside nothing but collectives, that CPU share had the cores to itself. In a job whose
local processes outnumber the cores the others compute meanwhile, and the collective's CPU part
runs as slowly as their compute: ``load`` times (the measured slowdown of a rank beside the job's
other processes, `cpu_sharing`). A collective's time is then ``measured x (1 + cpu_share x (load -
1))``: x 1.45 for an all-reduce share of 0.37 at load 2.2 (4 processes on 2 cores), where a GPT's
data-parallel step over 4 ranks was priced 20 % under its measured time without it
(bench/autodist.py). A point-to-point message is priced as measured: it was timed beside the
work already (its send completes during the sender's next work, `comm_profile._in_program`), and
adding its CPU share to the pipeline stages' work priced a 4-stage GPT 12 % over its step.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from nnscaler.ir import COST_MODELS

__all__ = ["CommModel", "DEFAULT_PROFILE", "COLLECTIVES", "monotone_points", "profile_key"]

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")

# Used only when nothing is measured and measuring is not possible (documented): a slow
# shared-memory link, so that communication is never free.
DEFAULT_PROFILE = {"backend": "default", "collectives": {c: {"2": [5e-5, 2e9]} for c in COLLECTIVES}}


def profile_key(n: int, world: Optional[int]) -> str:
    """The profile's key of a group of `n` in a job of `world` local processes: ``"n/world"``
    when several such groups run at once, else ``"n"``."""
    return f"{n}/{world}" if world and n < world and world % n == 0 else str(n)


def monotone_points(points) -> List[Tuple[float, float]]:
    """(wire bytes, seconds) sorted by size, each time no more than any larger message's: a
    small message that waited on a busy machine is noise, not a cost (the lower envelope)."""
    pts = sorted((float(b), float(t)) for b, t in points)
    out: List[Tuple[float, float]] = []
    low = float("inf")
    for b, t in reversed(pts):
        low = min(low, t)
        out.append((b, low))
    return out[::-1]


@dataclass
class CommModel:
    """`profile`'s times; `world`: the job's local processes, so a group of n < world is priced
    as measured with world / n groups at once (key ``"n/world"``) where the profile has it;
    `load`: how much slower the job's compute runs than a process alone (1: a device each), which
    slows a collective's CPU part (module docstring)."""
    profile: dict = field(default_factory=lambda: DEFAULT_PROFILE)
    world: int = 0
    load: float = 1.0

    def _entry(self, collective: str, n: int) -> list:
        table: Dict[str, list] = self.profile["collectives"].get(collective) or self.profile["collectives"]["all_reduce"]
        key = profile_key(n, self.world)
        if "/" in key and key in table:
            return table[key]
        sizes = sorted(int(k) for k in table if "/" not in k)
        best = min(sizes, key=lambda s: (abs(s - n), -s))
        return table[str(best)]

    def _points(self, collective: str, n: int) -> Optional[List[Tuple[float, float]]]:
        entry = self._entry(collective, n)
        if len(entry) > 2 and entry[2] and len(entry[2]) >= 2:
            return monotone_points(entry[2])
        return None

    def cpu_share(self, collective: str, n: int) -> float:
        """The measured share of a `collective` over `n` ranks spent on a CPU (0 if not measured)."""
        entry = self._entry(collective, n)
        return float(entry[3]) if len(entry) > 3 and entry[3] is not None else 0.0

    def _loaded(self, collective: str, n: int) -> float:
        if collective == "p2p":  # timed beside the work already: the send completes during the sender's next work
            return 1.0
        return 1.0 + self.cpu_share(collective, n) * max(0.0, self.load - 1.0)

    def latency(self, collective: str, n: int) -> float:
        """The fixed seconds of one `collective` over `n` ranks (0 for n <= 1): the smallest
        measured message's time, or the line's intercept (under the job's `load`)."""
        if n <= 1:
            return 0.0
        pts = self._points(collective, n)
        return (pts[0][1] if pts else float(self._entry(collective, n)[0])) * self._loaded(collective, n)

    def wire_time(self, collective: str, wire: float, n: int) -> float:
        """Seconds of `wire` bytes per rank of `collective` over `n` ranks (under the job's `load`)."""
        return self._measured(collective, wire, n) * self._loaded(collective, n)

    def _measured(self, collective: str, wire: float, n: int) -> float:
        pts = self._points(collective, n)
        if pts is None:
            lat, bw = self._entry(collective, n)[:2]
            return float(lat) + wire / float(bw)
        sizes = [b for b, _ in pts]
        i = bisect.bisect_left(sizes, wire)
        if i == 0:
            return pts[0][1]
        if i == len(pts):
            (b0, t0), (b1, t1) = pts[-2], pts[-1]
            slope = max((t1 - t0) / (b1 - b0), 0.0) if b1 > b0 else 0.0
            if slope == 0.0:  # a flat tail: at least the largest message's rate
                slope = t1 / b1
            return t1 + (wire - b1) * slope
        (b0, t0), (b1, t1) = pts[i - 1], pts[i]
        return t0 + (t1 - t0) * (wire - b0) / (b1 - b0)

    def time(self, collective: str, full_nbytes: float, n: int) -> float:
        """Seconds for `collective` over `n` ranks on a full tensor of `full_nbytes`."""
        if n <= 1 or full_nbytes <= 0:
            return 0.0
        wire = full_nbytes if collective == "p2p" else COST_MODELS["ring"](collective, full_nbytes, n)
        return self.wire_time(collective, wire, n)
