"""nnscaler.trainer.preemption: the SIGTERM handler records the signal instead of ending the
process, `requested` agrees across ranks, `close` puts the former handler back."""
from __future__ import annotations

import os
import signal
import threading

import pytest

from nnscaler.trainer.preemption import PreemptionWatch


def test_sigterm_is_recorded_and_the_process_lives_on():
    before = signal.getsignal(signal.SIGTERM)
    with PreemptionWatch() as watch:
        assert watch.installed and not watch.requested()
        os.kill(os.getpid(), signal.SIGTERM)  # without the handler this would end pytest
        assert watch.received == signal.SIGTERM and watch.requested()
    assert signal.getsignal(signal.SIGTERM) is before


def test_close_restores_a_handler_of_the_caller():
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda *a: seen.append("caller"))
    try:
        watch = PreemptionWatch()
        os.kill(os.getpid(), signal.SIGTERM)
        watch.close()
        assert seen == [] and watch.requested()
        os.kill(os.getpid(), signal.SIGTERM)
        assert seen == ["caller"]
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_off_the_main_thread_nothing_is_installed():
    before = signal.getsignal(signal.SIGTERM)
    out = []
    t = threading.Thread(target=lambda: out.append(PreemptionWatch()))
    t.start()
    t.join()
    assert not out[0].installed and signal.getsignal(signal.SIGTERM) is before
    out[0].close()  # nothing to restore


def _agree(rank, world):
    watch = PreemptionWatch()
    try:
        first = watch.requested()
        if rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return first, watch.received, watch.requested()
    finally:
        watch.close()


@pytest.mark.multiprocess
def test_a_rank_without_the_signal_stops_with_the_one_that_got_it():
    from launch import run_workers
    (first0, got0, agreed0), (first1, got1, agreed1) = run_workers(_agree, 2, timeout=60)
    assert (first0, first1) == (False, False)
    assert got0 is None and got1 == signal.SIGTERM
    assert agreed0 and agreed1
