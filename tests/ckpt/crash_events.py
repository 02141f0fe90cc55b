"""Counting a process's file events and SIGKILLing it at one of them (the crash tests' drivers)."""
from __future__ import annotations

import os
import signal


class FileEvents:
    """Wraps `targets` ((owner, attribute name) pairs); every call counts as one event, and the
    process SIGKILLs itself at event `kill_at` (0: never)."""

    def __init__(self, kill_at: int, targets):
        self.count = 0
        self.kill_at = kill_at
        for owner, name in targets:
            self._wrap(owner, name)

    def _wrap(self, owner, name):
        original = getattr(owner, name)

        def hooked(*args, **kwargs):
            self.count += 1
            if self.count == self.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return original(*args, **kwargs)
        setattr(owner, name, hooked)
