"""The backend adapter of runtime/failures/ (backends.py) read on the texts gloo printed on torch
2.13 (test_failures_gloo.py reproduces them on real processes), and its table."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from nnscaler.runtime.failures import backends
from nnscaler.runtime.failures.backends import (BACKENDS, CLOSED_AFTER_TIMEOUT, PEER_LOST, SLICE_END, TIMED_OUT,
                                                meaning)

from launch import world1  # noqa: F401 - fixture

PAIR = "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553]"
BUFFER = "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78]"


@pytest.mark.parametrize("text,means", [
    ("Operation timed out!", SLICE_END),
    (f"{PAIR} Connection closed by peer [127.0.0.1]:36263. This is typically caused by a remote worker crashing. "
     f"Check the logs of the remote worker before reporting an error. GLHF!", PEER_LOST),
    ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:19674: "
     "Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the application.",
     PEER_LOST),
    (f"{BUFFER} Timed out waiting 2000ms for recv operation to complete", TIMED_OUT),
    ("Application timeout caused pair closure", CLOSED_AFTER_TIMEOUT),
    ("NCCL error in: ProcessGroupNCCL.cpp:1, remote process exited or there was a network error, NCCL version 2.21.5",
     PEER_LOST),
    ("[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=668, OpType=ALLREDUCE) ran for 600097 "
     "milliseconds before timing out.", TIMED_OUT),
])
def test_each_message_is_read_for_what_it_means(text, means):
    assert meaning(RuntimeError(text)) == means


def test_other_errors_mean_nothing():
    size_mismatch = ("[enforce fail at pair.cc:446] op.preamble.length <= op.nbytes. 8 vs 4: Received data size "
                     "doesn't match expected size. Is there a distributed collective mismatch in your code?")
    assert meaning(RuntimeError(size_mismatch)) is None  # the ranks' collectives differ: a bug, it stands
    assert meaning(RuntimeError("Operation timed out! (and more)")) is None  # the slice's end is that exact text
    assert meaning(ValueError("Connection closed by peer")) is None  # not the backend's


def test_every_message_says_where_it_comes_from_and_each_backend_what_it_was_checked_on():
    assert {b.name for b in BACKENDS} == {"gloo", "nccl"}
    for backend in BACKENDS:
        for message in backend.messages:
            assert message.means in (SLICE_END, PEER_LOST, TIMED_OUT, CLOSED_AFTER_TIMEOUT) and message.seen
        assert all(v.count(".") == 2 for v in backend.checked), backend.checked
    gloo = next(b for b in BACKENDS if b.name == "gloo")
    assert gloo.polled and gloo.checked  # reproduced on real processes (test_failures_gloo.py)
    texts = [m.text.lower() for b in BACKENDS for m in b.messages]
    assert not [t for t in texts if sum(t in u for u in texts) > 1]  # no text contains another: one reading


def test_collective_work_is_waited_in_slices_and_tensors_on_a_device_plainly(world1):  # noqa: F811
    work = dist.all_reduce(torch.ones(2), async_op=True)
    work.wait()
    assert not backends.timed_wait_breaks(work)  # send / recv work is told apart in test_failures_gloo.py
    assert backends.runs_in_wait(dist.reduce_scatter_tensor) and not backends.runs_in_wait(dist.all_reduce)
    assert backends.polled(torch.ones(1)) and backends.polled(None)
    assert not backends.polled(torch.ones(1, device="meta"))
