"""Stalls: a collective that outlasts the default process group's timeout. A rank records in the
rendezvous store where it waits once a wait outlasts one slice (`arrive` / `leave`); when the
timeout passes, `timed_out` names the ranks of the group with no such record (alive, but outside
nnscaler's collectives) and those waiting in another collective. The waiting itself is waits.py's."""
from __future__ import annotations

from typing import Optional, Sequence

import torch.distributed as dist

from ..grid import default_timeout
from .errors import CollectiveTimeoutError
from .notices import PREFIX

__all__ = ["arrive", "leave", "timed_out"]


def arrive(store, what: str) -> Optional[str]:
    """Record in the store that this rank waits in `what` (only once a wait outlasts a slice);
    returns the key, None when the store is unreachable."""
    key = f"{PREFIX}waiting/{dist.get_rank()}"
    try:
        store.set(key, what)
    except Exception:  # noqa: BLE001 - only a peer's timeout message needs it
        return None
    return key


def leave(store, key: Optional[str]) -> None:
    """Remove the record `arrive` made (its key; None: nothing)."""
    if key is None:
        return
    try:
        store.delete_key(key)
    except Exception:  # noqa: BLE001
        pass


def timed_out(store, ranks: Sequence[int], what: str, waited_s: float) -> CollectiveTimeoutError:
    """The error of a wait in `what` that outlasted the default group's timeout: the ranks of the
    group with no arrival record did not arrive; ranks waiting in another collective are named."""
    me = dist.get_rank()
    missing, elsewhere = [], {}
    for r in ranks:
        if r == me:
            continue
        try:
            key = f"{PREFIX}waiting/{r}"
            where = store.get(key).decode() if store is not None and store.check([key]) else None
        except Exception:  # noqa: BLE001 - store unreachable: count it as not arrived
            where = None
        if where is None:
            missing.append(r)
        elif where != what:
            elsewhere[r] = where
    others = "".join(f"; rank {r} waits in {w} instead" for r, w in elsewhere.items())
    who = (f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} did not arrive" if missing
           else "every rank arrived but the collective did not complete")
    reason = (f"{what} (ranks {list(ranks)}) timed out after {waited_s:.0f} s: {who}{others}. A rank that does "
              f"not arrive is alive but outside nnscaler's collectives: it raised in its own loop and caught the "
              f"error (e.g. between forward and backward), stopped in a debugger, or runs a different sequence of "
              f"steps. The limit is the default process group's timeout (init_process_group(timeout=...); the "
              f"Trainer's collective_timeout, {default_timeout().total_seconds():.0f} s here); restart the job")
    return CollectiveTimeoutError(f"{reason}; this rank stopped waiting in {what}", missing, what, reason)
