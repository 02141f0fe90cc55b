"""Crash safety of ``merge(..., overwrite=True)`` over an earlier merge: the merging process is
SIGKILLed at every one of its file events (each write, fsync, mkdir, rename, kernel copy, the
directory exchange and the removal of the old merge); after each crash the destination is the
previous merge or the new one, whole. With the exchange unavailable (two renames), a crash between
the renames leaves a complete checkpoint beside the destination that the read error names."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from nnscaler.ir import exchange_paths


def _run(root, exchange):
    driver = os.path.join(os.path.dirname(os.path.abspath(__file__)), "merge_crash_driver.py")
    out = subprocess.run([sys.executable, driver, str(root), str(int(exchange))], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _check(report):
    results = report["results"]
    assert len(results) == report["events"] > 10
    assert all(r["killed"] for r in results), [r for r in results if not r["killed"]]  # every point was reached
    found = [r["found"] for r in results]
    assert None not in found, results  # always one whole merge, and no leftover taken for a checkpoint
    first_new = found.index("B")
    assert first_new > 0 and found == ["A"] * first_new + ["B"] * (len(found) - first_new), found
    assert any(r["leftovers"] for r in results)  # some crashes left a staging directory behind


@pytest.mark.multiprocess
def test_sigkill_during_merge_overwrite_keeps_a_whole_merge(tmp_path):
    probe = [tmp_path / "a", tmp_path / "b"]
    for p in probe:
        p.mkdir()
    exchanges = exchange_paths(*probe)
    (tmp_path / "run").mkdir()
    report = _run(tmp_path / "run", exchange=True)
    _check(report)
    if exchanges:  # the destination is never missing
        assert not any(r["restored"] for r in report["results"])


@pytest.mark.multiprocess
def test_sigkill_during_the_two_rename_fallback_loses_nothing(tmp_path):
    report = _run(tmp_path, exchange=False)
    _check(report)
    assert any(r["restored"] for r in report["results"])  # the window between the renames was hit
