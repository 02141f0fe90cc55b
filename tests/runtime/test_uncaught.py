"""Single-process parts of runtime/failures/uncaught.py; the peers' side is in
test_failures_uncaught.py."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from nnscaler.runtime import failures
from nnscaler.runtime.failures import uncaught


def _raise_here():
    raise RuntimeError("bad batch\nsecond line")


def test_the_summary_names_the_type_the_first_line_and_the_users_line():
    try:
        _raise_here()
    except RuntimeError as exc:
        text = failures.summary(exc)
    line = _raise_here.__code__.co_firstlineno + 1
    assert text == f"RuntimeError: bad batch at {__file__}:{line}", text
    assert failures.summary(ValueError("x"), "train.py:7") == "ValueError: x at train.py:7"


@pytest.mark.multiprocess  # a fresh interpreter
def test_importing_nnscaler_leaves_the_excepthook_alone():
    code = textwrap.dedent("""
        import sys
        import torch.distributed  # torch may install its own hook: that one is the reference
        before = sys.excepthook
        import nnscaler, nnscaler.runtime
        from nnscaler.runtime import failures
        assert sys.excepthook is before, sys.excepthook
        failures.install_excepthook()
        assert sys.excepthook is not before and sys.excepthook.__module__ == "nnscaler.runtime.failures.uncaught"
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr


@pytest.fixture
def fresh_hook(monkeypatch):
    """As in a process where the hook was never installed; everything restored afterwards."""
    seen, exits = [], []
    monkeypatch.setattr(sys, "excepthook", lambda *args: seen.append(args))
    monkeypatch.setattr(uncaught, "_installed", False)
    monkeypatch.setattr(uncaught, "_previous", None)
    monkeypatch.setattr(uncaught.atexit, "register", exits.append)
    return seen, exits


@pytest.mark.parametrize("how", ["install_excepthook", "arm"])  # arm: what building a ParallelModule runs
def test_the_hook_is_installed_once_and_chains_to_the_previous_one(how, fresh_hook):
    seen, exits = fresh_hook
    previous = sys.excepthook
    getattr(failures, how)()
    assert sys.excepthook is uncaught._excepthook and exits == [uncaught._at_exit]
    getattr(failures, how)()  # once per process
    assert uncaught._previous is previous and exits == [uncaught._at_exit]
    failures.reset()
    exc = RuntimeError("boom")
    sys.excepthook(RuntimeError, exc, None)
    assert seen == [(RuntimeError, exc, None)]  # the traceback is still printed by the hook it found
    assert failures.failed() is None and not uncaught._done  # one process: nothing posted, nothing refused
