"""tools/matrix_resume.py: the matrix's "resume on another plan" (save under plan X after 2 steps,
parallelize again under plan Y in the same processes, load, train the 3rd step) ends in parity
with one process trained 3 steps straight, for each case (dp + ZeRO-3 -> tp, tp -> pp + ZeRO-1,
pp -> dp + ZeRO-3, megatron + ZeRO-1 -> dp in float32, tp x dp -> pp x dp on 4 ranks); the control
(loading the model but not the optimizer) differs, so the comparison can fail. One launch per
world size."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))

import matrix_resume  # noqa: E402


def test_cases_change_plan_and_keep_the_world():
    cases = matrix_resume.cases()
    assert len({c["id"] for c in cases}) == len(cases) and [c["control"] for c in cases].count(True) == 1
    for c in cases:
        assert (c["x"]["plan"], c["x"]["zero"]) != (c["y"]["plan"], c["y"]["zero"]), c["id"]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_resume_on_another_plan_is_parity():
    records = matrix_resume.run_resume()
    for case in matrix_resume.cases():
        want = "differs" if case["control"] else "parity"
        assert records[case["id"]]["state"] == want, (case["id"], records[case["id"]])
