"""Which peer is gone, and the `PeerFailedError` that names it.

A rank killed outright (SIGKILL, the out-of-memory killer) posts no notice. The backend fails the
pending operation (see backends.py for its texts) or, killed in the middle of a transfer, may
leave it pending; either way the survivor looks up the processes of the operation's ranks (the
host and pid each one registered, notices.register) and names the rank whose process is gone. A
rank that posted a notice and then exited is named with its notice.
"""
from __future__ import annotations

import os
import socket
import time
from typing import List, Optional, Sequence, Tuple

import torch.distributed as dist

from . import backends, notices
from .errors import PeerFailedError

__all__ = ["alive", "dead_ranks", "notice_error", "died_error", "lost_connection", "lost_peer"]


def alive(pid: int) -> bool:
    """Whether process `pid` (on this host) runs: a killed child its parent has not reaped yet (a
    zombie) counts as dead."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return True


def _proc(st, rank: int) -> Optional[Tuple[str, int]]:
    """(host, pid) that `rank` registered, cached once read; None while it has not registered."""
    procs = notices.state().procs
    if rank not in procs:
        key = f"{notices.PREFIX}proc/{rank}"
        if not st.check([key]):
            return None
        host, pid = st.get(key).decode().rsplit(" ", 1)
        procs[rank] = (host, int(pid))
    return procs[rank]


def dead_ranks(st, ranks: Sequence[int]) -> Tuple[List[int], List[int]]:
    """(ranks whose process is gone, ranks that cannot be checked: not registered, or on another
    host) among `ranks` other than this one. Raises when the store cannot be reached."""
    dead, unknown, me, host = [], [], dist.get_rank(), socket.gethostname()
    for r in ranks:
        if r == me:
            continue
        proc = _proc(st, r)
        if proc is None or proc[0] != host:
            unknown.append(r)
        elif not alive(proc[1]):
            dead.append(r)
    return dead, unknown


def notice_error(rank: int, reason: str, what: str) -> PeerFailedError:
    """The error of a wait in `what` that found `rank`'s notice `reason`; the step is broken."""
    s = notices.state()
    s.broken = s.broken or reason
    return PeerFailedError(f"{reason}; this rank stopped waiting for it in {what}", rank, reason, died=False)


def died_error(dead: Sequence[int], what: str) -> PeerFailedError:
    """The error of a wait in `what` whose peers `dead` died without a notice; the step is broken."""
    which = ", ".join(str(r) for r in dead)
    reason = (f"rank {which} died (its process ended without reporting an error: killed, e.g. by SIGKILL or "
              f"the out-of-memory killer, or crashed)")
    s = notices.state()
    s.broken = s.broken or reason
    return PeerFailedError(f"{reason}; this rank stopped waiting for it in {what}", dead[0], None, died=True)


def lost_connection(st, ranks: Sequence[int], what: str, exc: BaseException) -> Optional[PeerFailedError]:
    """The `PeerFailedError` for the backend error `exc` of an operation over `ranks` in `what`:
    the notice a rank posted (then exited), the rank that died, or, for a lost connection
    (backends.PEER_LOST) whose rank cannot be told, what is known. None when `exc` is another error
    and no peer failed or died."""
    dead: List[int] = []
    unknown: Optional[List[int]] = None  # None: the store is unreachable
    others = [r for r in ranks if r != dist.get_rank()]
    if st is not None:
        try:
            found = notices.first_notice(st)
            if found is not None:  # the rank failed, posted its notice, then exited
                return notice_error(found[0], found[1], what)
            dead, unknown = dead_ranks(st, ranks)
            for _ in range(20):  # the connection drops while the killed process is still exiting
                if dead or len(unknown) == len(others):
                    break
                time.sleep(0.05)
                dead, unknown = dead_ranks(st, ranks)
        except Exception:  # noqa: BLE001 - the store itself is gone with its host process
            dead, unknown = [], None
    if dead:
        return died_error(dead, what)
    if backends.meaning(exc) != backends.PEER_LOST:
        return None  # not a lost peer (e.g. the process group's own timeout): the caller decides
    if unknown is None:
        reason = (f"a peer of {what} (ranks {list(ranks)}) lost its connection and the rendezvous store is "
                  f"unreachable: the process hosting it (rank 0 with init_method env:// or tcp://) most likely died")
    elif unknown:
        reason = (f"a peer of {what} (ranks {list(ranks)}; on another host or not registered: {unknown}) closed "
                  f"its connection: its process died or its host went away")
    else:
        reason = (f"a peer of {what} (ranks {list(ranks)}) closed its connection while its process is alive: it "
                  f"left the collective (destroyed its process group) or ran another sequence of collectives")
    s = notices.state()
    s.broken = s.broken or reason
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return PeerFailedError(f"{reason} (backend: {first[:200]})", None, None, died=True)


def lost_peer(exc: BaseException, what: str, ranks: Optional[Sequence[int]] = None) -> Optional[PeerFailedError]:
    """The `PeerFailedError` for the backend error `exc` from a blocking operation with `ranks`
    (default: all) in `what` when it is a lost connection: the rank and the error it posted (e.g.
    an uncaught exception), or that it died. None for any other error, or without peers."""
    if not notices.multi_rank() or backends.meaning(exc) != backends.PEER_LOST:
        return None
    ranks = tuple(ranks) if ranks is not None else tuple(range(dist.get_world_size()))
    return lost_connection(notices.store(), ranks, what, exc)
