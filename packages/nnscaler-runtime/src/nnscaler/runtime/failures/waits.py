"""Failures reach every rank: a rank that raises in a step makes every other rank raise too.
(One file over 400 lines: the notice, the watchful waits and their helper thread share one
per-process state and one protocol; the stall report lives in stalls.py.)

Without this, a rank that raises inside forward or backward while its process stays alive (the
user's loop logs the error and goes on, a debugger stops there) leaves its peers blocked in the
next collective they share with it (the gradient all-reduce, a tensor-parallel collective, ZeRO's
reduce-scatter) until that process exits.

The protocol (CPU / gloo collectives; see "Why a side channel" below):

* **Failure notice.** A rank whose step raises writes a notice into the job's rendezvous store
  (the key-value store torch.distributed was initialised with): its rank and its error
  (``rank 1 failed in forward: ValueError: ...``). A forward failure is seen by
  `ParallelModule.forward`; a backward failure by a callback that every backward pass through the
  module's outputs queues on the autograd engine: when the pass ends without running it, the pass
  raised (the error text is picked up as it leaves the engine; where a tracer such as a debugger is
  active, the notice says "failed in backward" without the text).
* **Watchful waits.** Every collective nnscaler issues during a step (the Reducer's bucket
  all-reduces, ZeRO's reduce-scatter / all-reduce / all-gather, the tensor-parallel collectives of
  `nnscaler.runtime.comm`, the gradient-norm all-reduce) is launched asynchronously and waited for
  in slices of `POLL_S` seconds. A collective that completes within the first slice costs nothing
  more than before. Between slices the waiter reads one counter in the store; once any rank has
  posted a notice it raises `PeerFailedError` naming that rank and its error. So every rank raises
  at its first collective that waits on the failed rank (directly or through a rank that already
  raised): in the failing step, or early in the next one for a rank whose step needed nothing more
  from it. gloo runs a reduce-scatter inside `work.wait()` and ignores the slice: that one is
  waited for on a helper thread. The pipeline executor posts its ranks' failures too (for the
  data-parallel peers in other units; its own poison messages serve the pipeline).
* **Dead peers.** A rank killed outright (SIGKILL, the OOM killer) posts nothing; gloo fails the
  pending collective within a second ("Connection closed by peer"). The waiter then looks up the
  processes of the collective's ranks (host and pid, registered when the module was built) and
  raises `PeerFailedError` saying which rank died, instead of gloo's message.
* **Exits, unpolled waits.** An uncaught exception posts a notice before the process exits
  (uncaught.py). Waits not polled (pipeline sends / receives, parallelize) see the connection
  close: `lost_peer` makes gloo's error there the same `PeerFailedError`.
* **Stalls.** A rank that stops taking part without failing inside nnscaler (it raised in its own
  loop between forward and backward and caught the error, a debugger holds it) posts nothing. A
  wait that outlasts one slice records in the store where this rank waits; once the default
  process group's timeout (``init_process_group(timeout=...)``, `grid.default_timeout`) has
  passed since the wait began, it raises `CollectiveTimeoutError` naming the ranks of the
  collective's group with no such record (they did not arrive) and where this rank waited. The
  backend's own timeout error (gloo's, at the same limit) becomes the same error. Groups made by
  grid.py carry the default group's timeout too.
* **Broken state.** After a failure (its own or a peer's) a process refuses later steps with
  `StepRefusedError`: the ranks' collectives are out of step, nothing can be trusted but a restart.

Why a side channel rather than a notice carried by the collective the peers wait for: the failing
rank would have to issue exactly the collective each peer is blocked in, with the same size, and
only its generated code knows which tensor-parallel collective comes next; the store reaches every
rank whatever it waits for, costs one small write on failure and nothing on the fast path.

Not covered: NCCL (device) collectives are not polled (the CPU does not block in them; use
``TORCH_NCCL_ASYNC_ERROR_HANDLING`` and the process-group timeout there: NCCL's watchdog
ends the process, without naming the missing ranks); a backward pass that
fails before it reaches the module's outputs (in the user's loss code) posts no notice; a notice
left by an earlier process group on the same store is seen by a later one.
"""
from __future__ import annotations

import os
import socket
import queue
import threading
import time
from datetime import timedelta
from typing import Any, Dict, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .device import is_distributed
from .errors import NnScalerError
from .grid import default_timeout
from .stalls import CollectiveTimeoutError, arrive as _arrive_at, leave as _leave, timed_out

__all__ = ["PeerFailedError", "StepRefusedError", "CollectiveTimeoutError", "POLL_S", "enabled", "arm", "report", "post", "check_step", "wait",
           "run", "lost_peer", "is_connection_error", "failed", "reset"]

POLL_S = 0.25  # seconds between two looks at the store while a collective is pending
# False turns the protocol off in this process (plain waits, no notices, no hooks): for
# measuring its cost (bench/failure_overhead.py). Every rank must agree.
enabled = True
_PREFIX = "nnscaler/failure/"
_COUNT = _PREFIX + "count"
_TIMEOUT_TEXT = "Operation timed out!"  # c10d Work.wait(timeout) when the slice ends


class PeerFailedError(NnScalerError, RuntimeError):
    """Another rank failed (or died) during this step; `rank` is that rank, `reason` its error
    (None when it died without one), `died` whether its process ended without reporting."""

    def __init__(self, message: str, rank: Optional[int], reason: Optional[str], died: bool):
        super().__init__(message)
        self.rank, self.reason, self.died = rank, reason, died


class StepRefusedError(NnScalerError, RuntimeError):
    """A step on a process whose earlier step failed (here or on a peer): restart the job."""


class _State:
    def __init__(self, owner: Any):
        self.owner = owner
        self.broken: Optional[str] = None  # why this process cannot run steps any more
        self.reported = False  # this rank posted its notice
        self.armed = False
        self.task: Optional[int] = None  # graph task of the last watched backward pass
        self.ranks: Dict[int, Tuple[int, ...]] = {}


_STATE = _State(None)


def _state() -> _State:
    global _STATE
    owner = dist.group.WORLD if is_distributed() else None
    if _STATE.owner is not owner:
        _STATE = _State(owner)
    return _STATE


def _multi_rank() -> bool:
    return enabled and is_distributed() and dist.get_world_size() > 1


def _store():
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store: the protocol is off, waits are plain
        return None


# -- this rank ------------------------------------------------------------------------------------
def arm() -> None:
    """Register this process (host, pid) so that peers can tell it died. Called when a
    ParallelModule is built; cheap and idempotent."""
    state = _state()
    if state.armed or not _multi_rank():
        return
    state.armed = True
    store = _store()
    if store is not None:
        try:
            store.set(f"{_PREFIX}proc/{dist.get_rank()}", f"{socket.gethostname()} {os.getpid()}")
        except Exception:  # noqa: BLE001 - best effort: only the "which rank died" text needs it
            pass


def failed() -> Optional[str]:
    """Why this process refuses steps (None while it can run them)."""
    return _state().broken


def reset() -> None:
    """Forget this process's failure state (tests; a new process group starts clean anyway)."""
    global _STATE
    _STATE = _State(dist.group.WORLD if is_distributed() else None)


def check_step(what: str) -> None:
    """Refuse a step after an earlier failure (here or on a peer)."""
    broken = _state().broken
    if broken is not None:
        raise StepRefusedError(
            f"{what}: an earlier step failed ({broken}); the ranks' collectives are out of step since, so no "
            f"step can run again in this job: restart it (every rank raises at its next collective)")


def report(exc: BaseException, phase: str) -> None:
    """This rank's step raised `exc` in `phase` ("forward", "backward"): post the notice every
    peer waiting in a collective will raise with, and refuse later steps here."""
    state = _state()
    if isinstance(exc, (PeerFailedError, StepRefusedError)) or not _multi_rank():
        return
    if getattr(exc, "raised_on_every_rank", False):  # e.g. a GuardError the ranks agreed on (guards.py):
        return  # every rank raised at the same point, their collectives are still in step
    text = f"{type(exc).__name__}: {exc}"
    notes = [str(n) for n in getattr(exc, "__notes__", ()) if str(n).strip()]
    if notes:  # e.g. the user's source line ParallelModule adds
        text += f" ({notes[0].strip().splitlines()[0]})"
    _post(state, f"rank {dist.get_rank()} failed in {phase}: {text}")


def post(reason: str) -> None:
    """Post `reason` ("rank R ...") as this rank's failure notice (its first stands) and refuse later
    steps here; nothing without peers. For an uncaught exception ending the process (uncaught.py)."""
    if _multi_rank():
        _post(_state(), reason)


def _post(state: _State, reason: str) -> None:
    if state.broken is None:
        state.broken = reason
    if state.reported:
        return
    state.reported = True
    store = _store()
    if store is None:
        return
    rank = dist.get_rank()
    try:
        store.set(f"{_PREFIX}rank{rank}", reason)
        n = store.add(_COUNT, 1)
        store.set(f"{_PREFIX}{n}", str(rank))
    except Exception:  # noqa: BLE001 - the store is gone: peers see the connection drop instead
        pass


# -- peers ------------------------------------------------------------------------------------------
def _notice(store) -> Optional[Tuple[int, str]]:
    """(rank, reason) of the first failure any rank posted, or None."""
    if store.add(_COUNT, 0) == 0:
        return None
    store.wait([f"{_PREFIX}1"], timedelta(seconds=10))
    rank = int(store.get(f"{_PREFIX}1").decode())
    return rank, store.get(f"{_PREFIX}rank{rank}").decode()


def _group_ranks(group) -> Tuple[int, ...]:
    state = _state()
    key = id(group)
    if key not in state.ranks:
        try:
            state.ranks[key] = tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
        except Exception:  # noqa: BLE001
            state.ranks[key] = tuple(range(dist.get_world_size()))
    return state.ranks[key]


def _dead(store, ranks: Sequence[int]) -> Tuple[Sequence[int], Sequence[int]]:
    """(ranks whose process is gone, ranks that could not be checked: on another host)."""
    dead, unknown, me, host = [], [], dist.get_rank(), socket.gethostname()
    for r in ranks:
        if r == me:
            continue
        key = f"{_PREFIX}proc/{r}"
        if not store.check([key]):
            unknown.append(r)
            continue
        their_host, pid = store.get(key).decode().rsplit(" ", 1)
        if their_host != host:
            unknown.append(r)
        elif not _alive(int(pid)):
            dead.append(r)
    return dead, unknown


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a killed child its parent has not reaped yet is a zombie: dead too
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return True


def _peer_failed(state: _State, rank: int, reason: str, what: str) -> PeerFailedError:
    state.broken = state.broken or reason
    return PeerFailedError(f"{reason}; this rank stopped waiting for it in {what}", rank, reason, died=False)


def _connection_lost(state: _State, store, group, what: str, exc: BaseException,
                     ranks: Optional[Sequence[int]] = None) -> Optional[PeerFailedError]:
    ranks = tuple(ranks) if ranks is not None else _group_ranks(group)
    if store is not None:
        try:
            found = _notice(store)
            if found is not None:  # the rank failed, posted its notice, then exited
                return _peer_failed(state, found[0], found[1], what)
            dead, unknown = _dead(store, ranks)
            for _ in range(20):  # the connection drops while the killed process is still exiting
                if dead or len(unknown) == len([r for r in ranks if r != dist.get_rank()]):
                    break
                time.sleep(0.05)
                dead, unknown = _dead(store, ranks)
        except Exception:  # noqa: BLE001 - the store itself is gone with its host process
            dead, unknown = [], None
    else:
        dead, unknown = [], None
    if dead:
        which = ", ".join(str(r) for r in dead)
        reason = (f"rank {which} died (its process ended without reporting an error: killed, e.g. by SIGKILL or "
                  f"the out-of-memory killer, or crashed)")
        state.broken = state.broken or reason
        return PeerFailedError(f"{reason}; this rank stopped waiting for it in {what}", dead[0], None, died=True)
    text = str(exc).lower()
    if unknown is not None and not any(w in text for w in ("connection", "closed", "reset", "broken pipe")):
        return None  # not a lost peer (e.g. the process group's own timeout): gloo's error stands
    if unknown is None:
        reason = (f"a peer of {what} (ranks {list(ranks)}) lost its connection and the rendezvous store is "
                  f"unreachable: the process hosting it (rank 0 with init_method env:// or tcp://) most likely died")
    elif unknown:
        reason = (f"a peer of {what} (ranks {list(ranks)}; on another host: {unknown}) closed its connection: "
                  f"its process died or its host went away")
    else:
        reason = (f"a peer of {what} (ranks {list(ranks)}) closed its connection while its process is alive: it "
                  f"left the collective (destroyed its process group) or ran another sequence of collectives")
    state.broken = state.broken or reason
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return PeerFailedError(f"{reason} (backend: {first[:200]})", None, None, died=True)


_LOST = ("connection closed", "connection reset", "broken pipe", "connection refused")  # gloo's texts


def is_connection_error(exc: BaseException) -> bool:
    """Whether `exc` is the backend's report of a lost connection to a peer (gloo's "Connection
    closed by peer", "Connection reset by peer", a broken pipe)."""
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(w in text for w in _LOST)


def lost_peer(exc: BaseException, what: str, ranks: Optional[Sequence[int]] = None) -> Optional[PeerFailedError]:
    """The `PeerFailedError` for the backend error `exc` from a blocking operation with `ranks`
    (default: all) in `what` when it is a lost connection: the rank and the error it posted (e.g.
    an uncaught exception), or that it died. None for any other error, or without peers."""
    if not _multi_rank() or not is_connection_error(exc):
        return None
    ranks = tuple(ranks) if ranks is not None else tuple(range(dist.get_world_size()))
    return _connection_lost(_state(), _store(), None, what, exc, ranks)


def _polled(tensor: Optional[torch.Tensor]) -> bool:
    return tensor is None or tensor.device.type == "cpu"


def _stalled(state: _State, store, group, what: str, waited_s: float) -> CollectiveTimeoutError:
    """`stalls.timed_out` for a wait of this process; the step is broken from here on."""
    error = timed_out(store, _group_ranks(group), what, waited_s, _PREFIX)
    state.broken = state.broken or error.reason
    return error


# gloo runs these collectives inside `work.wait()` itself (the work is not started before, and
# ignores a wait timeout): they are waited for on a helper thread instead.
_WAIT_RUNS_IT = {f for f in (getattr(dist, "reduce_scatter_tensor", None), getattr(dist, "reduce_scatter_single", None))
                 if f is not None}
_HELPER: Optional["queue.SimpleQueue"] = None


def _helper_loop(jobs: "queue.SimpleQueue") -> None:
    while True:
        work, errors, done = jobs.get()
        try:
            work.wait()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            errors.append(exc)
        done.set()


def _wait_on_helper(work) -> Tuple[list, threading.Event]:
    """(errors, done): `work.wait()` runs on a daemon thread (it never holds up the exit of a
    process whose peer failed mid-collective)."""
    global _HELPER
    if _HELPER is None:
        _HELPER = queue.SimpleQueue()
        threading.Thread(target=_helper_loop, args=(_HELPER,), daemon=True, name="nnscaler-collective-wait").start()
    errors, done = [], threading.Event()
    _HELPER.put((work, errors, done))
    return errors, done


def wait(work, what: str, group=None, tensor: Optional[torch.Tensor] = None, runs_in_wait: bool = False) -> None:
    """Wait for the async collective `work` (over `group`) like `work.wait()`, raising
    `PeerFailedError` as soon as any rank has posted a failure notice or a peer's process died,
    and `CollectiveTimeoutError` once the default process group's timeout has passed.
    `what` names the collective in messages ("the gradient all-reduce"). Device (NCCL) work whose
    `tensor` is not on the CPU is waited for plainly. `runs_in_wait`: the backend runs the
    collective inside `work.wait()` (gloo's reduce-scatter): waited for on a helper thread."""
    if not _polled(tensor) or not _multi_rank():
        work.wait()
        return
    state, store, waiting = _state(), None, None
    slice_ = timedelta(seconds=POLL_S)
    future = _wait_on_helper(work) if runs_in_wait else None
    start, limit = time.monotonic(), None
    try:
        while True:
            try:
                if future is None:
                    work.wait(slice_)
                    break
                if not future[1].wait(POLL_S):
                    raise RuntimeError(_TIMEOUT_TEXT)
                if future[0]:
                    raise future[0][0]
                break
            except RuntimeError as exc:
                if str(exc).strip() != _TIMEOUT_TEXT:
                    store = store if store is not None else _store()
                    lost = _connection_lost(state, store, group, what, exc)
                    if lost is None and "timed out" in str(exc).lower():  # the backend's own timeout
                        lost = _stalled(state, store, group, what, time.monotonic() - start)
                    if lost is None:
                        raise
                    raise lost from None
            if store is None:
                store = _store()
                if store is None:  # no side channel: a plain wait (the backend's timeout applies)
                    if future is None:
                        work.wait()
                    else:
                        future[1].wait()
                        if future[0]:
                            raise future[0][0]
                    return
            if waiting is None:  # slow path only: say where this rank waits, for a peer's timeout
                waiting = _arrive_at(store, what, _PREFIX)
            try:
                found = _notice(store)
            except Exception:  # noqa: BLE001 - store unreachable: keep waiting, gloo reports the dead peer
                found = None
            if found is not None:
                raise _peer_failed(state, found[0], found[1], what)
            limit = limit if limit is not None else default_timeout().total_seconds()
            if time.monotonic() - start >= limit:
                raise _stalled(state, store, group, what, time.monotonic() - start)
    except CollectiveTimeoutError:
        raise  # the arrival record stays: a peer timing out later still counts this rank as arrived
    except BaseException:
        _leave(store, waiting)
        raise
    _leave(store, waiting)


def run(fn, *args, what: str, group=None, **kwargs):
    """`fn(*args, group=group, async_op=True, **kwargs)` (a torch.distributed collective) waited
    for with `wait`; returns None like the blocking call."""
    tensor = next((a for a in args if isinstance(a, torch.Tensor)), None)
    work = fn(*args, group=group, async_op=True, **kwargs)
    wait(work, what, group, tensor, runs_in_wait=fn in _WAIT_RUNS_IT)
