"""How the ranks of one save meet once their files are written: every rank's `RankOutcome` (its
files' records, or the error it met) reaches rank 0, which commits, and every rank then learns
the verdict. The writer (`executor.execute`) is the same either way; only the meeting differs:

* `Collective`: the caller's process group (`save`): one all-gather of the outcomes, one
  broadcast of rank 0's verdict.
* `Markers`: no process group (the background processes of `async_save`): each rank > 0 writes
  ``.done-rank-0000r.json`` into the staging directory; rank 0 waits for every marker (at most
  `SavePlan.timeout` seconds: a rank whose process died is named), removes them and commits; on
  failure it deletes the staging directory. The other ranks wait until the staging directory is
  gone: committed when the manifest at the destination lists their file with the record they
  wrote (a file's metadata names its save, so no earlier file has it), failed otherwise.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from nnscaler.ir import atomic_write

from .collectives import all_gather_json, broadcast_json
from .errors import CheckpointError
from .manifest import read_manifest
from .plan import SavePlan
from .records import FileRecord

__all__ = ["RankOutcome", "Collective", "Markers", "done_marker"]

_POLL = 0.005  # seconds between looks at the staging directory


@dataclass
class RankOutcome:
    """What one rank wrote: its files' records, or the error every rank reports."""

    rank: int
    records: Dict[str, FileRecord] = field(default_factory=dict)
    error: Optional[str] = None

    def to_json(self) -> Dict[str, Any]:
        return {"rank": self.rank, "records": {n: r.to_json() for n, r in self.records.items()}, "error": self.error}

    @classmethod
    def from_json(cls, data: Dict[str, Any]) -> "RankOutcome":
        return cls(data["rank"], {n: FileRecord.from_json(r, n) for n, r in data["records"].items()}, data["error"])


class Collective:
    """The ranks meet over the default process group (or are one process)."""

    def gather(self, plan: SavePlan, mine: RankOutcome) -> Optional[List[RankOutcome]]:
        """Every rank's outcome, by rank, on rank 0 (None elsewhere)."""
        gathered = all_gather_json(mine.to_json())
        return [RankOutcome.from_json(g) for g in gathered] if plan.rank == 0 else None

    def verdict(self, plan: SavePlan, mine: RankOutcome, error: Optional[str]) -> Optional[str]:
        """Rank 0's `error` (None: committed), on every rank."""
        return broadcast_json(error)


def done_marker(staging: Path, rank: int) -> Path:
    return staging / f".done-rank-{rank:05d}.json"


class Markers:
    """The ranks meet through files in the staging directory (see the module docstring)."""

    def gather(self, plan: SavePlan, mine: RankOutcome) -> Optional[List[RankOutcome]]:
        """Rank > 0: write the marker (None). Rank 0: every rank's outcome, by rank, its markers
        removed; a rank that wrote none in time comes first, with the error naming it."""
        stage = plan.staging.path
        if plan.rank != 0:
            try:
                atomic_write(done_marker(stage, plan.rank), json.dumps(mine.to_json()))
            except OSError as e:
                mine.error = mine.error or (f"rank {plan.rank} could not write to {stage} ({e}); the previous "
                                            f"checkpoint is intact")
            return None
        deadline = time.monotonic() + plan.timeout
        found: Dict[int, RankOutcome] = {0: mine}
        while len(found) < plan.world:
            for r in range(1, plan.world):
                if r not in found and done_marker(stage, r).is_file():
                    try:
                        found[r] = RankOutcome.from_json(json.loads(done_marker(stage, r).read_text("utf-8")))
                    except (OSError, ValueError, KeyError, TypeError) as e:
                        found[r] = RankOutcome(r, error=f"rank {r}'s marker in {stage} is unreadable ({e})")
            if len(found) < plan.world:
                if time.monotonic() > deadline:
                    late = [r for r in range(plan.world) if r not in found]
                    return [RankOutcome(late[0], error=(
                        f"rank{'s' if len(late) > 1 else ''} {', '.join(map(str, late))} did not write "
                        f"{'their files' if len(late) > 1 else 'its file'} of {plan.dest} within {plan.timeout:g} s "
                        f"(a save process may have died); the previous checkpoint is intact")), *found.values()]
                time.sleep(_POLL)
        outcomes = [found[r] for r in range(plan.world)]
        if not any(o.error for o in outcomes):
            try:
                for r in range(1, plan.world):
                    done_marker(stage, r).unlink()
            except OSError as e:
                outcomes[0] = RankOutcome(0, error=f"{plan.dest}: the commit failed ({e}); the previous checkpoint "
                                                   f"is intact")
        return outcomes

    def verdict(self, plan: SavePlan, mine: RankOutcome, error: Optional[str]) -> Optional[str]:
        """Rank 0: its `error`. A rank > 0: its own error, else None once its file is committed."""
        if plan.rank == 0 or mine.error:
            return error if plan.rank == 0 else mine.error
        stage = plan.staging.path
        deadline = time.monotonic() + plan.timeout
        while stage.exists():
            if time.monotonic() > deadline:
                return (f"rank 0 did not commit {plan.dest} within {plan.timeout:g} s (its process may have died); "
                        f"the previous checkpoint is intact; delete {stage}")
            time.sleep(_POLL)
        try:
            committed = read_manifest(plan.dest).files.get(plan.file) == mine.records[plan.file]
        except (CheckpointError, OSError):
            committed = False
        return None if committed else (f"rank 0 did not commit {plan.dest} (its error says why); the previous "
                                       f"checkpoint is intact")
