"""Single-process parts of runtime/uncaught.py; the peers' side is in test_failures_uncaught.py."""
from __future__ import annotations

import sys

from nnscaler.runtime import failures, uncaught


def _raise_here():
    raise RuntimeError("bad batch\nsecond line")


def test_the_summary_names_the_type_the_first_line_and_the_users_line():
    try:
        _raise_here()
    except RuntimeError as exc:
        text = uncaught.summary(exc)
    line = _raise_here.__code__.co_firstlineno + 1
    assert text == f"RuntimeError: bad batch at {__file__}:{line}", text
    assert uncaught.summary(ValueError("x"), "train.py:7") == "ValueError: x at train.py:7"


def test_the_hook_is_installed_on_import_and_chains_to_the_previous_one(monkeypatch):
    assert sys.excepthook is uncaught._excepthook or uncaught._installed  # torch may have wrapped it since
    seen = []
    monkeypatch.setattr(uncaught, "_previous", lambda *args: seen.append(args))
    failures.reset()
    exc = RuntimeError("boom")
    uncaught._excepthook(RuntimeError, exc, None)
    assert seen == [(RuntimeError, exc, None)]  # the traceback is still printed by the hook it found
    assert failures.failed() is None and not uncaught._done  # one process: nothing posted, nothing refused
