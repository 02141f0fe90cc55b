"""A rank whose process ends by an uncaught exception tells its peers why before it exits.

Without this, a rank that raises outside nnscaler's steps (in the user's own loop, between forward
and backward, before `parallelize`) posts no failure notice (notices.py): its peers wait in their
next collective until the process exits, then name it as "died ... killed, e.g. by SIGKILL".

`install()` wraps ``sys.excepthook``, keeping the hook it found (torch's, which prefixes
``[rankN]:``, or Python's). It runs when a ParallelModule is built and when `parallelize` starts
(`nnscaler.runtime.failures.arm`), or when the user calls
`nnscaler.runtime.failures.install_excepthook()` (to cover what raises before `parallelize`);
importing nnscaler leaves ``sys.excepthook`` alone. When an exception reaches the top of the main
thread of a process in a multi-rank job, the hook posts the notice
``rank R raised RuntimeError: <message> at <file>:<line> (uncaught: it ends that process)``
(the deepest frame of the user's code) through `notices.post`, then lets the process print its
traceback and exit as before. A peer waiting in a polled collective raises `PeerFailedError` with
that text within `waits.POLL_S`; one blocked elsewhere (a pipeline receive, a parallelize
collective) when the exiting process's connections close. The post is bounded (`POST_S`) so an
unreachable store never holds up the exit. An ``atexit`` fallback posts the same notice when a
later ``sys.excepthook`` replaced this one without calling it (Python keeps the exception in
``sys.last_value``).

Not reported: an exception that only ends a thread (the process goes on), errors that are a
consequence of a peer's failure (`PeerFailedError`, `StepRefusedError`, a lost connection: the
first notice already names the cause), `SystemExit`, and a process whose launcher catches the
exception itself (multiprocessing workers, ``torch.multiprocessing.spawn``: that parent ends the
other ranks anyway).
"""
from __future__ import annotations

import atexit
import sys
import threading
from typing import Optional

import torch.distributed as dist

from nnscaler.ir import is_internal

from . import backends, notices
from .errors import PeerFailedError, StepRefusedError

__all__ = ["install", "summary", "call_site", "POST_S"]

POST_S = 5.0  # at most this long is spent posting the notice before the process goes on exiting
_installed = False
_previous = None
_done = False  # this process reported its uncaught exception


def install() -> None:
    """Wrap ``sys.excepthook`` (once per process) and register the atexit fallback; later calls do
    nothing."""
    global _installed, _previous
    if _installed:
        return
    _installed = True
    _previous = sys.excepthook
    sys.excepthook = _excepthook
    atexit.register(_at_exit)


def summary(exc: BaseException, where: Optional[str] = None) -> str:
    """``Type: first line of the message at file:line``: `where`, else the deepest frame of the
    user's code in its traceback (the deepest frame when every one is nnscaler's, torch's or
    Python's own)."""
    lines = str(exc).strip().splitlines()
    text = type(exc).__name__ + (f": {lines[0][:500]}" if lines else "")
    notes = [str(n).strip() for n in getattr(exc, "__notes__", ()) if str(n).strip()]
    if notes:  # e.g. the user's model source line ParallelModule adds
        text += f" ({notes[0].splitlines()[0]})"
    where = where or _user_frame(exc)
    return text + (f" at {where}" if where else "")


def call_site() -> Optional[str]:
    """``file:line`` of the innermost frame of the user's code calling into nnscaler now."""
    frame = sys._getframe(1)
    while frame is not None and is_internal(frame.f_code.co_filename):
        frame = frame.f_back
    return f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame is not None else None


def _user_frame(exc: BaseException) -> Optional[str]:
    tb, last, user = exc.__traceback__, None, None
    while tb is not None:
        code = tb.tb_frame.f_code
        last = f"{code.co_filename}:{tb.tb_lineno}"
        if not is_internal(code.co_filename):
            user = last
        tb = tb.tb_next
    return user or last


def _report(exc: Optional[BaseException]) -> None:
    global _done
    if _done or exc is None or isinstance(exc, SystemExit):
        return
    if (not notices.multi_rank() or isinstance(exc, (PeerFailedError, StepRefusedError))
            or getattr(exc, "raised_on_every_rank", False) or backends.meaning(exc) == backends.PEER_LOST):
        return
    _done = True
    reason = f"rank {dist.get_rank()} raised {summary(exc)} (uncaught: it ends that process)"
    poster = threading.Thread(target=notices.post, args=(reason,), daemon=True, name="nnscaler-exit-notice")
    try:
        poster.start()
    except RuntimeError:  # no new thread at interpreter shutdown (the atexit fallback): post here
        notices.post(reason)
        return
    poster.join(POST_S)


def _excepthook(exc_type, exc, tb) -> None:
    try:
        _report(exc)
    except BaseException:  # noqa: BLE001 - the report is best effort: the traceback must still print
        pass
    (_previous or sys.__excepthook__)(exc_type, exc, tb)


def _at_exit() -> None:
    try:
        _report(getattr(sys, "last_exc", None) or getattr(sys, "last_value", None))
    except BaseException:  # noqa: BLE001 - never fail an exit
        pass
