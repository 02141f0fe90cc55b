"""`AsyncSave`: the handle `async_save` returns, finished by the background process's answer."""
from __future__ import annotations

import threading
import warnings
from pathlib import Path
from typing import Optional

from nnscaler.ir import NnScalerWarning

from .errors import CheckpointError

__all__ = ["AsyncSave", "AsyncSaveWarning"]


class AsyncSaveWarning(NnScalerWarning):
    """An asynchronous save failed and nobody called its handle's ``wait()``."""


class AsyncSave:
    """The handle of one `async_save`: ``done()`` tells whether it finished, ``wait()`` blocks until
    it is committed and returns its path, or raises the CheckpointError it met (on every call)."""

    def __init__(self, path: Path):
        self.path = path
        self._finished = threading.Event()
        self._error: Optional[str] = None
        self._observed = False

    def finish(self, error: Optional[str]) -> None:
        """Called once the background process answered (or died): None when committed, else the error."""
        if not self._finished.is_set():
            self._error = error
            self._finished.set()

    def done(self) -> bool:
        """True once the save is committed or has failed (never blocks)."""
        return self._finished.is_set()

    def wait(self, timeout: Optional[float] = None) -> Path:
        """Block until the checkpoint is committed (at most `timeout` seconds, then a
        CheckpointError); returns its path. Raises the save's error if it failed."""
        if not self._finished.wait(timeout):
            raise CheckpointError(f"{self.path}: the asynchronous save is still being written after {timeout:g} s; "
                                  f"wait longer (or call wait() without a timeout)")
        self._observed = True
        if self._error:
            raise CheckpointError(self._error)
        return self.path

    def join(self) -> None:
        """Wait without raising; warn (`AsyncSaveWarning`) when it failed and nobody waited for it."""
        self._finished.wait()
        if self._error and not self._observed:
            self._observed = True
            warnings.warn(f"the asynchronous save to {self.path} failed: {self._error}", AsyncSaveWarning,
                          stacklevel=4)
