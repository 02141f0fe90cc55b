"""Single-process parts of the failure protocol (runtime/failures/); the multi-process behaviour
is in test_failures_dp.py and test_failures_gloo.py."""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest
import torch

from nnscaler.runtime import failures
from nnscaler.runtime.failures import backward, peers


def _queue_pass_end(record):
    def hook(grad):
        torch.autograd.Variable._execution_engine.queue_callback(backward._PassEnd(record.append))
    return hook


def test_a_failed_backward_pass_hands_its_error_over():
    seen = []
    w = torch.nn.Parameter(torch.ones(3))
    x = torch.nn.Parameter(torch.ones(3))

    def bad(grad):
        raise ValueError("boom in backward")
    x.register_hook(bad)
    loss = (x * 2 * w).sum()
    loss.register_hook(_queue_pass_end(seen))
    try:
        loss.backward()
    except ValueError as exc:
        assert str(exc) == "boom in backward"  # the user's error reaches the user unchanged
    else:
        raise AssertionError("backward did not raise")
    assert len(seen) == 1 and isinstance(seen[0], ValueError) and str(seen[0]) == "boom in backward"


def test_a_successful_backward_pass_reports_nothing():
    seen = []
    w = torch.nn.Parameter(torch.ones(3))
    loss = (w * 2).sum()
    loss.register_hook(_queue_pass_end(seen))
    loss.backward()
    assert seen == [] and torch.equal(w.grad, torch.full((3,), 2.0))


def test_single_process_errors_leave_the_process_usable():
    # Without peers nothing is posted and nothing is refused: a caught error does not end training.
    failures.reset()
    failures.report(ValueError("boom"), "forward")
    assert failures.failed() is None
    failures.check_step("Model.forward")


def _sleep():
    time.sleep(60)


@pytest.mark.multiprocess  # forks a process and kills it
def test_a_killed_process_counts_as_dead_even_before_it_is_reaped():
    assert peers.alive(os.getpid())
    proc = mp.get_context("fork").Process(target=_sleep)
    proc.start()
    try:
        assert peers.alive(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while peers.alive(proc.pid) and time.monotonic() < deadline:  # a zombie until joined
            time.sleep(0.01)
        assert not peers.alive(proc.pid)
    finally:
        proc.join()
    assert not peers.alive(proc.pid)
