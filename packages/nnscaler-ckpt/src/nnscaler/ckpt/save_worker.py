"""The background process of `async_save`: ``main([FD, SIZE, PARENT, THREADS, RESULTS_FD])`` in a
fresh interpreter, one per rank, persistent across saves. It maps the caller's shared memory
(file descriptor `FD`, `SIZE` bytes, inherited), reads one JSON line ``{"seq": n, "plan": SavePlan}``
per save on stdin, executes the plan with the same writer as `save` (`executor.execute`: write
from the buffer while hashing, fsync, rank 0 commits) with the ranks meeting through markers in
the staging directory (`rendezvous.Markers`), and answers one JSON line ``{"seq": n, "error":
null | message}`` per save on `RESULTS_FD`. Nothing is pickled and the caller's script is not
imported again (as a ``spawn`` child would).

A kill at any moment (of this process or of the training process: this one exits with its parent)
leaves the previous checkpoint untouched and at most a staging directory, which nothing takes for
a checkpoint.
"""
from __future__ import annotations

import json
import mmap
import os
import signal
import sys
import threading
import time
from typing import List

import torch

from .buffer_layout import views
from .executor import execute
from .plan import SavePlan
from .rendezvous import Markers

__all__ = ["main", "NICE"]

NICE = 10  # the process's scheduling priority below training's: on busy cores training's steps go first


def _exit_with_parent(parent: int) -> None:
    """Exit within a fraction of a second of the training process (on Linux the kernel kills this
    process at once: `async_save.PROLOGUE` asked it to, before the imports)."""
    def watch() -> None:
        while True:
            if os.getppid() != parent:
                os._exit(1)
            time.sleep(0.2)
    if os.getppid() != parent:
        os._exit(1)
    threading.Thread(target=watch, daemon=True).start()


def main(argv: List[str]) -> None:
    """The process's loop (see the module docstring); ends at the end of stdin."""
    fd, size, parent, threads, results_fd = map(int, argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops training, not a save being written
    _exit_with_parent(parent)
    try:
        os.nice(NICE)
    except OSError:  # not permitted here: same priority as training
        pass
    torch.set_num_threads(max(1, threads))
    buffer = torch.frombuffer(mmap.mmap(fd, size), dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)
    os.close(fd)
    results = os.fdopen(results_fd, "w", buffering=1)
    markers = Markers()
    for line in sys.stdin:
        job = json.loads(line)
        plan = SavePlan.from_json(job["plan"])
        try:
            error = execute(plan, views(buffer, plan.specs), markers)
        except BaseException as e:  # noqa: BLE001 - reported to the caller's handle
            error = f"rank {plan.rank}: {type(e).__name__}: {e}"
        results.write(json.dumps({"seq": job["seq"], "error": error}) + "\n")
