"""The one owner of this process's checkpoint work in flight (`OWNER`, the package's only
module-level state): the asynchronous save not yet waited for (its handle), the work a synchronous
save left for after its commit (rank 0's thread, `after_commit`), and the background process with
its shared buffer that asynchronous saves write through (`background`).

Every `save` and `async_save` begins with `OWNER.settle()`: at most one save is in flight per
process, and a save never starts while the previous one's after-commit work runs.
`stop_async_saves()` (and the interpreter's exit) settles and ends the background process. A
forked child (a data loader's worker) owns nothing in flight: the parent's process, buffer,
handle and thread stay the parent's.
"""
from __future__ import annotations

import atexit
import os
import threading
from typing import Optional

from .background import BackgroundProcess
from .handle import AsyncSave

__all__ = ["InFlight", "OWNER", "in_flight", "wait_in_flight"]


class InFlight:
    """What is in flight: `handle` (the asynchronous save), `after_commit_thread`, `background`."""

    def __init__(self):
        self.handle: Optional[AsyncSave] = None
        self.after_commit_thread: Optional[threading.Thread] = None
        self.background = BackgroundProcess()

    def track(self, handle: AsyncSave) -> None:
        """`handle` is the asynchronous save in flight (its caller settled first)."""
        self.handle = handle

    def wait_async(self) -> None:
        """Wait until the asynchronous save in flight, if any, is committed or has failed (its error
        is its handle's to raise; `AsyncSave.join` warns about one nobody waited for)."""
        handle = self.handle
        if handle is not None:
            handle.join()
            self.handle = None

    def run_after_commit(self, target, *args) -> None:
        """Run `target(*args)` in the after-commit thread (not a daemon: the interpreter waits for
        it at exit), once the previous one is done."""
        self.wait_after_commit()
        self.after_commit_thread = threading.Thread(target=target, args=args, name=THREAD_NAME)
        self.after_commit_thread.start()

    def wait_after_commit(self) -> None:
        thread, self.after_commit_thread = self.after_commit_thread, None
        if thread is not None:
            thread.join()

    def settle(self) -> None:
        """Wait for everything in flight: the asynchronous save, then the after-commit work."""
        self.wait_async()
        self.wait_after_commit()

    def stop(self, release: bool = False) -> None:
        """Settle, then end the background process (the next `async_save` starts a new one); with
        `release` free its shared buffer too."""
        self.settle()
        self.background.stop()
        if release:
            self.background.release_buffer()

    def forget(self) -> None:
        """In a forked child: nothing is in flight."""
        self.handle, self.after_commit_thread = None, None
        self.background.forget()


THREAD_NAME = "nnscaler-ckpt-after-commit"
OWNER = InFlight()
os.register_at_fork(after_in_child=OWNER.forget)
atexit.register(OWNER.stop)


def in_flight() -> Optional[AsyncSave]:
    """The asynchronous save in flight, or None."""
    return OWNER.handle


def wait_in_flight() -> None:
    """`OWNER.wait_async()`."""
    OWNER.wait_async()
