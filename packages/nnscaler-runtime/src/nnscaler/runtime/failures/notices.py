"""This process's failure state, and the failure notices ranks leave in the rendezvous store.

A rank whose step raises posts a notice (``rank 1 failed in forward: ValueError: ...``) under
``nnscaler/failure/`` in the store torch.distributed was initialised with: its text under
``rank<R>``, then a counter every waiting peer reads between two slices of its wait, and the order
in which ranks posted (the first notice is the one peers raise with). A process also registers its
host and pid there (`register`) so that its peers can tell it died.

The state lives per default process group: a new group (a restarted job in the same process, a
test) starts clean.
"""
from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any, Dict, Optional, Tuple

import torch.distributed as dist

from ..device import is_distributed
from .errors import PeerFailedError, StepRefusedError

__all__ = ["PREFIX", "State", "state", "multi_rank", "store", "register", "failed", "reset", "check_step", "report",
           "post", "first_notice", "group_ranks"]

PREFIX = "nnscaler/failure/"
_COUNT = PREFIX + "count"
# False turns the protocol off in this process (plain waits, no notices, no hooks): for measuring
# its cost (bench/failure_overhead.py, through `nnscaler.runtime.failures.enabled`). Every rank must agree.
enabled = True


class State:
    def __init__(self, owner: Any):
        self.owner = owner  # the default process group this state belongs to
        self.broken: Optional[str] = None  # why this process cannot run steps any more
        self.reported = False  # this rank posted its notice
        self.registered = False  # this rank's host and pid are in the store
        self.backward_task: Optional[int] = None  # graph task of the last watched backward pass (backward.py)
        self.ranks: Dict[int, Tuple[int, ...]] = {}  # id(group) -> its ranks
        self.procs: Dict[int, Tuple[str, int]] = {}  # rank -> (host, pid) as registered (peers.py)


_STATE = State(None)


def state() -> State:
    """This process's state under the current default process group."""
    global _STATE
    owner = dist.group.WORLD if is_distributed() else None
    if _STATE.owner is not owner:
        _STATE = State(owner)
    return _STATE


def multi_rank() -> bool:
    """Whether the protocol runs: on, with a process group of more than one rank."""
    return enabled and is_distributed() and dist.get_world_size() > 1


def store():
    """The rendezvous store of the default process group; None without one."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store: the protocol is off, waits are plain
        return None


def register() -> None:
    """Record this process (host, pid) in the store so that peers can tell it died; once per
    process group, nothing without peers."""
    s = state()
    if s.registered or not multi_rank():
        return
    s.registered = True
    st = store()
    if st is not None:
        try:
            st.set(f"{PREFIX}proc/{dist.get_rank()}", f"{socket.gethostname()} {os.getpid()}")
        except Exception:  # noqa: BLE001 - best effort: only the "which rank died" text needs it
            pass


def failed() -> Optional[str]:
    """Why this process refuses steps (None while it can run them)."""
    return state().broken


def reset() -> None:
    """Forget this process's failure state (tests; a new process group starts clean anyway)."""
    global _STATE
    _STATE = State(dist.group.WORLD if is_distributed() else None)


def check_step(what: str) -> None:
    """Refuse a step after an earlier failure (here or on a peer)."""
    broken = state().broken
    if broken is not None:
        raise StepRefusedError(
            f"{what}: an earlier step failed ({broken}); the ranks' collectives are out of step since, so no "
            f"step can run again in this job: restart it (every rank raises at its next collective)")


def report(exc: BaseException, phase: str) -> None:
    """This rank's step raised `exc` in `phase` ("forward", "backward"): post the notice every
    peer waiting in a collective will raise with, and refuse later steps here."""
    if isinstance(exc, (PeerFailedError, StepRefusedError)) or not multi_rank():
        return
    if getattr(exc, "raised_on_every_rank", False):  # e.g. a GuardError the ranks agreed on (guards.py):
        return  # every rank raised at the same point, their collectives are still in step
    text = f"{type(exc).__name__}: {exc}"
    notes = [str(n) for n in getattr(exc, "__notes__", ()) if str(n).strip()]
    if notes:  # e.g. the user's source line ParallelModule adds
        text += f" ({notes[0].strip().splitlines()[0]})"
    post(f"rank {dist.get_rank()} failed in {phase}: {text}")


def post(reason: str) -> None:
    """Post `reason` ("rank R ...") as this rank's failure notice (its first stands) and refuse later
    steps here; nothing without peers."""
    if not multi_rank():
        return
    s = state()
    if s.broken is None:
        s.broken = reason
    if s.reported:
        return
    s.reported = True
    st = store()
    if st is None:
        return
    rank = dist.get_rank()
    try:
        st.set(f"{PREFIX}rank{rank}", reason)
        n = st.add(_COUNT, 1)
        st.set(f"{PREFIX}{n}", str(rank))
    except Exception:  # noqa: BLE001 - the store is gone: peers see the connection drop instead
        pass


def first_notice(st) -> Optional[Tuple[int, str]]:
    """(rank, reason) of the first failure any rank posted in `st`, or None. Raises when the store
    cannot be reached."""
    if st.add(_COUNT, 0) == 0:
        return None
    st.wait([f"{PREFIX}1"], timedelta(seconds=10))
    rank = int(st.get(f"{PREFIX}1").decode())
    return rank, st.get(f"{PREFIX}rank{rank}").decode()


def group_ranks(group) -> Tuple[int, ...]:
    """The global ranks of `group` (None: the default group), cached."""
    s = state()
    key = id(group)
    if key not in s.ranks:
        try:
            s.ranks[key] = tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
        except Exception:  # noqa: BLE001
            s.ranks[key] = tuple(range(dist.get_world_size()))
    return s.ranks[key]
