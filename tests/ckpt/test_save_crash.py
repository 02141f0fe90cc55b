"""Crash safety: the saving ranks are SIGKILLed at 20 seeded points spread over a save (every file
write, fsync, mkdir and rename of either rank is a candidate); after each crash the checkpoint at
the path verifies and loads: the previous one, or the new one when the kill came after its commit.
The same for `async_save` of two gloo ranks: first an uninterrupted one (committed before either
rank's wait() returns, holding the state at the call although the ranks change it at once), then
its background processes SIGKILLed at seeded file events, and the training processes at moments of
the save (their background processes die with them)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

POINTS = 20
SEED = 14


@pytest.mark.multiprocess
def test_sigkill_during_save_keeps_the_previous_checkpoint(tmp_path):
    driver = os.path.join(os.path.dirname(os.path.abspath(__file__)), "crash_driver.py")
    out = subprocess.run([sys.executable, driver, str(tmp_path), str(POINTS), str(SEED)], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    results = report["results"]
    assert len(results) == POINTS
    assert all(r["ok"] for r in results), [r for r in results if not r["ok"]]
    killed = [r for r in results if r["killed"]]
    assert len(killed) == POINTS  # every point was reached: each save really died
    assert any(r["leftovers"] for r in results)  # some crashes left a staging directory behind
    assert len({tuple(r["point"]) for r in results}) == POINTS  # distinct points, spread over the save
    assert {r["point"][0] for r in results} == {0, 1}  # both ranks were killed first somewhere


ASYNC_POINTS = 3


@pytest.mark.multiprocess
def test_sigkill_during_async_save_keeps_the_previous_checkpoint(tmp_path):
    driver = os.path.join(os.path.dirname(os.path.abspath(__file__)), "crash_driver.py")
    out = subprocess.run([sys.executable, driver, str(tmp_path), str(ASYNC_POINTS), str(SEED), "async"],
                         capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])["results"]
    assert len(results) == ASYNC_POINTS + 2
    assert all(r["ok"] for r in results), [r for r in results if not r["ok"]]
    assert all(r["killed"] for r in results), [r for r in results if not r["killed"]]
    assert all(not r["alive_after"] for r in results)  # no background process outlives its training process
    assert any(r["leftovers"] for r in results)  # some crashes left a staging directory behind
    assert all(r["errors"] for r in results if r["what"] == "worker")  # the surviving rank was told
