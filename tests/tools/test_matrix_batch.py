"""tools/matrix_batch.py's records of a launch that failed on a case (fast tier, no process): a
case whose ranks' deadline dumped their stacks is a hang with the stacks attached, any other
failure a crash with the exception's line. The launches themselves run in
test_matrix_sample.py's multiprocess test (the CI sample, with a case that crashes mid-launch)."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))

import matrix_batch  # noqa: E402

CRASH = ("--- rank 0 ---\nTraceback (most recent call last):\n  File \"x.py\", line 1, in f\n"
         "KeyError: 'no-such-model'\n--- rank 1 ---\nrank 1 died with exit code -15 and no report")


def test_a_failed_case_is_a_crash_or_a_hang(tmp_path):
    (tmp_path / "stacks.0.txt").write_text("")
    got = matrix_batch._failure(str(tmp_path), 2, CRASH)
    assert got["state"] == "crash" and got["error"] == "KeyError: 'no-such-model'" and "rank 1" in got["details"]
    (tmp_path / "stacks.1.txt").write_text('Thread 0x1 (most recent call first):\n  File "gloo.py", line 9 in wait\n')
    got = matrix_batch._failure(str(tmp_path), 2, "rank 1 died with exit code 1 and no report")
    assert got["state"] == "hang" and "gloo.py" in got["stacks"]["1"] and got["stacks"]["0"] == ""
    assert "deadline" in got["error"]
