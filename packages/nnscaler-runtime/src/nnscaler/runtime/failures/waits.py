"""Watchful waits: a collective of a step is launched asynchronously and waited for in slices of
`POLL_S` seconds; between two slices the waiter looks for trouble.

* A collective that completes within the first slice costs nothing more than ``work.wait()``.
* After each slice: one counter in the store says whether any rank posted a failure notice
  (notices.py); if so, `PeerFailedError` with that rank and its error.
* Every `LIVENESS_SLICES` slices: whether a process of the collective's group has gone (peers.py;
  a peer killed in the middle of a transfer can leave gloo waiting); if so, "rank R died".
* Once the default process group's timeout has passed since the wait began:
  `CollectiveTimeoutError` naming the ranks that never arrived (stalls.py).
* An error of the backend is read by backends.py: a lost connection becomes the `PeerFailedError`
  of peers.py, the backend's own timeout the same `CollectiveTimeoutError`; any other error stands.

Work the backend runs inside ``wait()`` (gloo's reduce-scatter) and work that a timed wait would
break (gloo's send / receive) is waited for on a helper thread instead, the slices being waits
for that thread. Device (NCCL) work is waited for plainly.
"""
from __future__ import annotations

import os
import queue
import threading
import time
from datetime import timedelta
from typing import List, Optional, Tuple

import torch

from ..grid import default_timeout
from . import backends, notices, peers, stalls
from .errors import CollectiveTimeoutError, StepRefusedError

__all__ = ["POLL_S", "LIVENESS_SLICES", "wait", "run"]

POLL_S = 0.25  # seconds between two looks at the store while a collective is pending
LIVENESS_SLICES = 4  # slices between two looks at the group's processes (about a second)


def wait(work, what: str, group=None, tensor: Optional[torch.Tensor] = None) -> None:
    """Wait for the async collective `work` (over `group`) like `work.wait()`, raising
    `PeerFailedError` as soon as any rank has posted a failure notice or a peer's process died,
    and `CollectiveTimeoutError` once the default process group's timeout has passed.
    `what` names the collective in messages ("the gradient all-reduce"). Device (NCCL) work whose
    `tensor` is not on the CPU is waited for plainly."""
    _wait(work, what, group, tensor, on_helper=False)


def run(fn, *args, what: str, group=None, **kwargs):
    """`fn(*args, group=group, async_op=True, **kwargs)` (a torch.distributed collective) waited
    for with `wait`; returns None like the blocking call."""
    tensor = next((a for a in args if isinstance(a, torch.Tensor)), None)
    work = fn(*args, group=group, async_op=True, **kwargs)
    _wait(work, what, group, tensor, on_helper=backends.runs_in_wait(fn))


def _wait(work, what: str, group, tensor: Optional[torch.Tensor], on_helper: bool) -> None:
    if not backends.polled(tensor) or not notices.multi_rank():
        work.wait()
        return
    helper = _on_helper(work) if on_helper or backends.timed_wait_breaks(work) else None
    st, waiting, slices = None, None, 0
    start, limit = time.monotonic(), None
    try:
        while True:
            try:
                if _one_slice(work, helper):
                    break
            except RuntimeError as exc:
                st = st if st is not None else notices.store()
                error = _backend_error(exc, st, group, what, time.monotonic() - start)
                if error is None:
                    raise
                raise error from None
            if st is None:
                st = notices.store()
                if st is None:  # no side channel: a plain wait (the backend's timeout applies)
                    _plain(work, helper)
                    return
            if waiting is None:  # slow path only: say where this rank waits, for a peer's timeout
                waiting = stalls.arrive(st, what)
            try:
                found = notices.first_notice(st)
            except Exception:  # noqa: BLE001 - store unreachable: keep waiting, the backend reports the dead peer
                found = None
            if found is not None:
                raise peers.notice_error(found[0], found[1], what)
            slices += 1
            if slices % LIVENESS_SLICES == 0:
                dead = _dead(st, group)
                if dead:
                    raise peers.died_error(dead, what)
            limit = limit if limit is not None else default_timeout().total_seconds()
            if time.monotonic() - start >= limit:
                raise _stalled(st, group, what, time.monotonic() - start)
    except CollectiveTimeoutError:
        raise  # the arrival record stays: a peer timing out later still counts this rank as arrived
    except BaseException:
        stalls.leave(st, waiting)
        raise
    stalls.leave(st, waiting)


def _one_slice(work, helper) -> bool:
    """Wait one slice: True when `work` completed, False when the slice ended first; the backend's
    error otherwise."""
    if helper is None:
        try:
            work.wait(timedelta(seconds=POLL_S))
        except RuntimeError as exc:
            if backends.meaning(exc) == backends.SLICE_END:
                return False
            raise
        return True
    errors, done = helper
    if not done.wait(POLL_S):
        return False
    if errors:
        raise errors[0]
    return True


def _plain(work, helper) -> None:
    if helper is None:
        work.wait()
        return
    errors, done = helper
    done.wait()
    if errors:
        raise errors[0]


def _backend_error(exc: RuntimeError, st, group, what: str, waited_s: float) -> Optional[BaseException]:
    """The error to raise for the backend's error `exc` in a wait; None: `exc` itself stands."""
    lost = peers.lost_connection(st, notices.group_ranks(group), what, exc)  # a notice, a dead rank, a lost peer
    if lost is not None:
        return lost
    meaning = backends.meaning(exc)
    if meaning == backends.TIMED_OUT:
        return _stalled(st, group, what, waited_s)
    if meaning == backends.CLOSED_AFTER_TIMEOUT:
        s = notices.state()
        earlier = s.broken or "a timed-out operation outside nnscaler's waits"
        s.broken = s.broken or f"the backend closed this process's connections in {what} after a timeout"
        return StepRefusedError(f"{what}: the backend closed this process's connections after an earlier operation "
                                f"timed out ({earlier}); no collective can complete in this job: restart it")
    return None


def _dead(st, group) -> List[int]:
    try:
        return peers.dead_ranks(st, notices.group_ranks(group))[0]
    except Exception:  # noqa: BLE001 - store unreachable: the backend reports the dead peer
        return []


def _stalled(st, group, what: str, waited_s: float) -> CollectiveTimeoutError:
    """`stalls.timed_out` for a wait of this process; the step is broken from here on."""
    error = stalls.timed_out(st, notices.group_ranks(group), what, waited_s)
    s = notices.state()
    s.broken = s.broken or error.reason
    return error


# -- helper threads: each runs one `work.wait()` at a time; one busy with a wait its caller gave up
# on (a peer failed) never holds up a later wait, which gets another thread.
_IDLE: "queue.SimpleQueue" = queue.SimpleQueue()  # the job queues of idle helper threads


def _helper_loop(jobs: "queue.SimpleQueue") -> None:
    while True:
        work, errors, done = jobs.get()
        try:
            work.wait()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            errors.append(exc)
        done.set()
        # an idle thread holds nothing: the finished work keeps its tensors alive (gloo's reduce-scatter:
        # the whole gradient it was sent, e.g. an embedding's) until the next job would replace it
        work = errors = done = exc = None
        _IDLE.put(jobs)


def _on_helper(work) -> Tuple[list, threading.Event]:
    """(errors, done): `work.wait()` runs on a daemon thread (it never holds up the exit of a
    process whose peer failed mid-collective)."""
    try:
        jobs = _IDLE.get_nowait()
    except queue.Empty:
        jobs = queue.SimpleQueue()
        threading.Thread(target=_helper_loop, args=(jobs,), daemon=True, name="nnscaler-collective-wait").start()
    errors: list = []
    done = threading.Event()
    jobs.put((work, errors, done))
    return errors, done


def _forget_helpers() -> None:  # a forked child has none of its parent's threads
    global _IDLE
    _IDLE = queue.SimpleQueue()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_helpers)
