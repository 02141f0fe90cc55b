"""The tracer that is active on this thread, if any.

`register_op` wrappers and other hooks ask `current_tracer()` whether a trace is running: when it
is, a registered custom op is recorded as one node instead of being executed op by op.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Optional

from .surface import TracerSurface

_state = threading.local()


def current_tracer() -> Optional[TracerSurface]:
    """The active tracer, or None when no trace is running on this thread."""
    return getattr(_state, "tracer", None)


@contextlib.contextmanager
def activate(tracer: Optional[TracerSurface]) -> Iterator[Optional[TracerSurface]]:
    """Make `tracer` the active tracer for the duration of the block (re-entrant)."""
    previous = current_tracer()
    _state.tracer = tracer
    try:
        yield tracer
    finally:
        _state.tracer = previous
