"""Per-rank counters of the collectives this process actually runs (off by default).

Every collective nnscaler runs through `nnscaler.runtime.comm` (forward and backward) calls
`record(name, nbytes)`; the data-parallel reducer may call it too. Counting costs one bool
check when nothing listens.

Keys are the collective that ran: ``all_reduce``, ``all_gather``, ``reduce_scatter``,
``all_to_all``, or ``<name>(fallback)`` when the backend lacked ``<name>`` and the fallback of
`nnscaler.runtime.comm.fallbacks` ran in its place (e.g. ``reduce_scatter(fallback)``: an
all-reduce plus a local slice).

**Bytes convention ("payload").** ``bytes`` is the size of the tensor this rank hands *into*
the collective, whatever algorithm the backend uses on the wire:

==================  ==========================  =======================================
collective          payload (B = full tensor)   ring / pairwise wire bytes sent per rank
==================  ==========================  =======================================
all_reduce          B (the whole tensor)        2(n-1)/n * B
all_gather          B/n (the local shard)       (n-1)/n * B
reduce_scatter      B (the whole input)         (n-1)/n * B
all_to_all          B/n (the local shard)       (n-1)/n * B/n
==================  ==========================  =======================================

A fallback records the payload of the collective it really ran (the all-reduce of a
reduce-scatter fallback records B; the all-gather of an all-to-all fallback records B/n).
`nnscaler.codegen.adapters.steps_cost` gives both models analytically.

Two ways to listen, usable together:

* the process-wide counter: `enable_stats()`, `disable_stats()`, `reset_stats()`,
  `stats_snapshot()`;
* `with count_collectives() as stats:` a fresh `CommStats` that counts only what runs inside
  the block (nested blocks each see their own part), readable during and after it.
"""
from __future__ import annotations

import contextlib
from typing import Dict, Iterator, List, Optional

__all__ = ["CommStats", "enable_stats", "disable_stats", "reset_stats", "stats_snapshot",
           "stats_enabled", "count_collectives", "record", "global_stats"]


class CommStats:
    """Counts of collectives by name: ``calls`` and ``bytes`` (payload, see the module doc)."""

    __slots__ = ("_counts",)

    def __init__(self) -> None:
        self._counts: Dict[str, List[int]] = {}

    def add(self, name: str, nbytes: int) -> None:
        entry = self._counts.get(name)
        if entry is None:
            self._counts[name] = [1, int(nbytes)]
        else:
            entry[0] += 1
            entry[1] += int(nbytes)

    def reset(self) -> None:
        self._counts.clear()

    def snapshot(self) -> Dict[str, Dict[str, int]]:
        """A copy: ``{collective_name: {'calls': int, 'bytes': int}}``."""
        return {k: {"calls": v[0], "bytes": v[1]} for k, v in sorted(self._counts.items())}

    def calls(self, name: Optional[str] = None) -> int:
        """Calls of `name` (exact key), or of every collective when `name` is None."""
        if name is None:
            return sum(v[0] for v in self._counts.values())
        return self._counts.get(name, (0, 0))[0]

    def bytes(self, name: Optional[str] = None) -> int:
        """Payload bytes of `name` (exact key), or of every collective when `name` is None."""
        if name is None:
            return sum(v[1] for v in self._counts.values())
        return self._counts.get(name, (0, 0))[1]

    @property
    def fallbacks(self) -> Dict[str, int]:
        """``{collective: calls}`` of the collectives that ran through a fallback."""
        return {k[:-len("(fallback)")]: v[0] for k, v in self._counts.items() if k.endswith("(fallback)")}

    def __bool__(self) -> bool:
        return bool(self._counts)

    def __repr__(self) -> str:
        return f"CommStats({self.snapshot()})"


_GLOBAL = CommStats()
_GLOBAL_ON = False
_SCOPES: List[CommStats] = []
_ON = False  # _GLOBAL_ON or any scope open: the one check `record` makes


def record(name: str, nbytes: int) -> None:
    """Count one call of collective `name` moving `nbytes` payload bytes (no-op when off)."""
    if not _ON:
        return
    if _GLOBAL_ON:
        _GLOBAL.add(name, nbytes)
    for scope in _SCOPES:
        scope.add(name, nbytes)


def _refresh() -> None:
    global _ON
    _ON = _GLOBAL_ON or bool(_SCOPES)


def enable_stats() -> None:
    """Start counting into the process-wide counter (keeps what it already holds)."""
    global _GLOBAL_ON
    _GLOBAL_ON = True
    _refresh()


def disable_stats() -> None:
    """Stop counting into the process-wide counter (keeps what it holds)."""
    global _GLOBAL_ON
    _GLOBAL_ON = False
    _refresh()


def stats_enabled() -> bool:
    return _GLOBAL_ON


def reset_stats() -> None:
    """Empty the process-wide counter."""
    _GLOBAL.reset()


def stats_snapshot() -> Dict[str, Dict[str, int]]:
    """``{collective_name: {'calls': int, 'bytes': int}}`` of the process-wide counter."""
    return _GLOBAL.snapshot()


def global_stats() -> CommStats:
    """The live process-wide counter."""
    return _GLOBAL


@contextlib.contextmanager
def count_collectives() -> Iterator[CommStats]:
    """Count the collectives run inside the block into a fresh `CommStats` (yielded, live)."""
    stats = CommStats()
    _SCOPES.append(stats)
    _refresh()
    try:
        yield stats
    finally:
        _SCOPES.remove(stats)
        _refresh()
