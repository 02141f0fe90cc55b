"""This process's asynchronous save in flight (at most one): `save` and `async_save` wait for it
before they start."""
from __future__ import annotations

from typing import Any, Optional

__all__ = ["in_flight", "set_in_flight", "wait_in_flight"]

_current: Optional[Any] = None  # an async_save.AsyncSave


def in_flight() -> Optional[Any]:
    return _current


def set_in_flight(handle: Optional[Any]) -> None:
    global _current
    _current = handle


def wait_in_flight() -> None:
    """Wait until the save in flight, if any, is committed or has failed (its error is its
    handle's to raise; `AsyncSave.join` warns about one nobody waited for)."""
    handle = _current
    if handle is not None:
        handle.join()
        set_in_flight(None)
