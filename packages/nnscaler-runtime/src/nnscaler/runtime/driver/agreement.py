"""Every rank of `parallelize()` raises when one rank's own checks of its arguments fail.

`parallelize` checks its arguments on every rank (``dummy_forward_args`` is a dict, a usable
``gen_savedir``, ...), then rank 0 generates while the others wait for its outcome. A check that
fails on one rank only (its own ``dummy_forward_args``) used to raise there alone: the other ranks
waited for it in parallelize's next collective until its process exited, then raised gloo's
"Connection closed by peer".

So the ranks agree once their checks are done, before rank 0 generates (`ArgumentAgreement`:
one all-gather of a small JSON record per rank over the default group, waited for like the
step's collectives, failures/): a rank whose checks raised contributes its error and raises it;
every other rank raises `PeerFailedError` naming that rank and its error. After the agreement,
gloo's lost-connection error from a peer that exited (its uncaught exception, failures/uncaught.py, or a
kill) is raised as `PeerFailedError` too (`ArgumentAgreement.error_for`).
"""
from __future__ import annotations

import json
from typing import List, Optional

import torch
import torch.distributed as dist

from .. import failures
from ..failures import PeerFailedError
from ..failures import call_site, summary

__all__ = ["ArgumentAgreement"]


class ArgumentAgreement:
    """The agreement of one `parallelize()` call (`what` names it in messages)."""

    def __init__(self, what: str = "parallelize()"):
        self.what = what
        self.reached = False  # this rank took part in the agreement

    def passed(self) -> None:
        """Collective: this rank's checks passed; raise `PeerFailedError` when another rank's failed."""
        self.reached = True
        outcomes = _gather(None)
        bad = [(r, o) for r, o in enumerate(outcomes) if o is not None]
        if not bad:
            return
        ranks = ", ".join(str(r) for r, _ in bad)
        reason = "; ".join(f"rank {r} raised {o}" for r, o in bad)
        raise PeerFailedError(
            f"{self.what} failed on rank{'s' if len(bad) > 1 else ''} {ranks} (its own arguments): {reason}. Every "
            f"rank raises here; fix the call on rank {bad[0][0]} (each rank checks the arguments it passes)",
            bad[0][0], reason, died=False)

    def error_for(self, exc: BaseException) -> BaseException:
        """What `parallelize()` raises for `exc`, raised on this rank: before the agreement, `exc`,
        once the other ranks (waiting in the agreement) have it; after it, gloo's lost-connection
        error as `PeerFailedError` (the peer that exited, and why); otherwise `exc`."""
        if not self.reached:
            self.reached = True
            try:
                _gather(_describe(exc))
            except Exception:  # noqa: BLE001 - a peer is gone too: this rank's own error is what it raises
                pass
            return exc
        return failures.lost_peer(exc, self.what) or exc


def _describe(exc: BaseException) -> str:
    text = summary(exc, call_site())  # the rank's parallelize() call
    rest = str(exc).strip().splitlines()[1:]
    return text + ("\n" + "\n".join(rest[:20]) if rest else "")


def _gather(outcome: Optional[str]) -> List[Optional[str]]:
    """Every rank's `outcome`, by rank (collective over the default group; [outcome] alone)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [outcome]
    failures.arm()  # peers can tell this process died (failures/)
    data = json.dumps(outcome).encode()
    world = dist.get_world_size()
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    what = "parallelize()'s agreement on the ranks' arguments"
    failures.run(dist.all_gather, sizes, torch.tensor([len(data)], dtype=torch.int64), what=what)
    longest = max(int(s.item()) for s in sizes)
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    bufs = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
    failures.run(dist.all_gather, bufs, mine, what=what)
    return [json.loads(b[:int(s.item())].numpy().tobytes()) for b, s in zip(bufs, sizes)]
