"""runtime/failures/waits.py's helper threads (where gloo's reduce-scatter is waited for): an idle
helper holds nothing of the work it finished. It used to keep the last work, and with it the tensors
the backend holds (a use_zero=3 rank's whole last gradient sent to the reduce-scatter, an embedding's
or a head's), in the resident set until the next reduce-scatter."""
from __future__ import annotations

import gc
import time
import weakref

import torch
import torch.distributed as dist

from nnscaler.runtime.failures import waits

from launch import world1  # noqa: F401 - fixture


def test_an_idle_helper_thread_holds_no_finished_work(world1):  # noqa: F811
    x = torch.ones(1 << 16)
    ref = weakref.ref(x)
    work = dist.all_reduce(x, async_op=True)  # the work holds x
    del x
    errors, done = waits._on_helper(work)
    del work
    assert done.wait(30) and not errors
    deadline = time.monotonic() + 10
    while ref() is not None and time.monotonic() < deadline:  # the helper drops it once it is idle again
        gc.collect()
        time.sleep(0.01)
    assert ref() is None, "the helper thread still holds the finished work's tensors"
