"""Communication time: latency + bytes / bandwidth, per collective and group size, measured.

A profile is ``{"backend": ..., "collectives": {name: {str(n): [latency_s, bytes_per_s]}}}``
where bytes are the ring algorithm's wire bytes per rank (`nnscaler.ir.COST_MODELS["ring"]`).
`measure_comm` fits it from real collectives on `n` local processes (comm_profile.py); group
sizes not measured are priced with the nearest measured size.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Tuple

from nnscaler.ir import COST_MODELS

__all__ = ["CommModel", "DEFAULT_PROFILE"]

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")

# Used only when nothing is measured and measuring is not possible (documented): a slow
# shared-memory link, so that communication is never free.
DEFAULT_PROFILE = {"backend": "default", "collectives": {c: {"2": [5e-5, 2e9]} for c in COLLECTIVES}}


@dataclass
class CommModel:
    profile: dict = field(default_factory=lambda: DEFAULT_PROFILE)

    def _fit(self, collective: str, n: int) -> Tuple[float, float]:
        table: Dict[str, list] = self.profile["collectives"].get(collective) or self.profile["collectives"]["all_reduce"]
        sizes = sorted(int(k) for k in table)
        best = min(sizes, key=lambda s: (abs(s - n), -s))
        lat, bw = table[str(best)]
        return float(lat), float(bw)

    def latency(self, collective: str, n: int) -> float:
        """The fixed seconds of one `collective` over `n` ranks (0 for n <= 1)."""
        return 0.0 if n <= 1 else self._fit(collective, n)[0]

    def time(self, collective: str, full_nbytes: float, n: int) -> float:
        """Seconds for `collective` over `n` ranks on a full tensor of `full_nbytes`."""
        if n <= 1 or full_nbytes <= 0:
            return 0.0
        lat, bw = self._fit(collective, n)
        wire = full_nbytes if collective == "p2p" else COST_MODELS["ring"](collective, full_nbytes, n)
        return lat + wire / bw
