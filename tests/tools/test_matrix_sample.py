"""tools/matrix_sample.py: CI's sample of the compatibility matrix has two-way coverage (computed
here from the cases and bench/results/matrix.json: every valid pair of values of any two axes is
in a sample case; *valid* = some case of the full matrix holding it trains, the pairs only refused
cases hold are refusals, not pairs to cover), is fixed, and holds only training cases; and
(multiprocess) the sample, run many cases per launch (tools/matrix_batch.py), ends in parity (or
refused, for a case the full matrix has not run yet), in one launch per world size and model."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))

import matrix  # noqa: E402
import matrix_cases as mc  # noqa: E402
import matrix_sample as ms  # noqa: E402


@pytest.fixture(scope="module")
def cases():
    return mc.generate()


@pytest.fixture(scope="module")
def records():
    return matrix.load_results(matrix.RESULTS).get("cases", {})


def _covered(sample):
    return set().union(*(mc.pairs_of(c) for c in sample))


def test_the_sample_covers_every_valid_pair(cases, records):
    sample = ms.ci_sample(records, cases)
    cov = ms.coverage(records, cases)
    kinds = list(cov.values())
    assert sum(len(k) for k in kinds) == len(mc.all_pairs()) and set().union(*kinds) == mc.all_pairs()
    assert not cov["unheld"]  # the full design holds every pair the harness allows
    missing = cov["train"] - _covered(sample)
    assert not missing, sorted(missing)[:5]
    assert all(ms.trains(c, records) for c in sample)  # no case known to be refused or to fail
    # every model is sampled with every plan it trains under (so at least that many cases)
    model_plan = {p for p in cov["train"] if p[0][0] == "model" and p[1][0] == "plan"}
    assert len(sample) >= len(model_plan) >= len(mc.AXES["model"])
    assert [c["id"] for c in ms.ci_sample(records, cases)] == [c["id"] for c in sample]  # fixed
    print(f"CI sample: {ms.summary(sample, records)} (cases, recorded seconds); pairs: "
          + ", ".join(f"{k} {len(v)}" for k, v in cov.items()))


def test_refused_pairs_need_no_case_and_cheap_cases_win(cases):
    gpt2_cp = [c for c in cases if c["model"] == "gpt2" and c["plan"] == "cp"]
    records = {c["id"]: {"state": "refused", "seconds": 0.5} for c in gpt2_cp}
    slow = next(c for c in cases if c["model"] == "vit" and c["plan"] == "dp")
    records[slow["id"]] = {"state": "parity", "seconds": 500.0}
    failed = next(c for c in cases if c["model"] == "bert" and c["plan"] == "tp" and c["zero"] == "1")
    records[failed["id"]] = {"state": "crash", "seconds": 1.0}
    cov = ms.coverage(records, cases)
    pair = (("model", "gpt2"), ("plan", "cp"))
    assert pair in cov["refused"] and pair not in cov["train"]
    sample = ms.ci_sample(records, cases)
    assert pair not in _covered(sample) and cov["train"] <= _covered(sample)
    ids = {c["id"] for c in sample}
    assert slow["id"] not in ids and failed["id"] not in ids
    # a baseline rerun recorded in the results is a candidate too
    base = dict(gpt2_cp[0], dropout="off")
    records["x~base"] = {"state": "parity", "seconds": 1.0, "base_of": gpt2_cp[0]["id"],
                         "case": {a: base[a] for a in mc.AXES}}
    assert pair in ms.coverage(records, cases)["train"]
    assert pair in _covered(ms.ci_sample(records, cases))


def test_cli_ci_list(capsys):
    assert matrix.main(["--ci", "--list", "--plan", "tp"]) == 0
    ids = capsys.readouterr().out.split()
    records = matrix.load_results(matrix.RESULTS).get("cases", {})
    assert ids == [c["id"] for c in ms.ci_sample(records) if c["plan"] == "tp"] and ids


@pytest.mark.multiprocess
@pytest.mark.slow
def test_ci_sample_trains_to_parity(records):
    """The sample for real, one launch per world size and model. A case that crashes in the
    middle of a launch (a precision the harness does not know: KeyError on every rank) is recorded
    as a crash and the cases after it run in a fresh launch."""
    import matrix_batch
    sample = ms.ci_sample(records)
    two = [c for c in sample if mc.PLANS[c["plan"]][2] == 2]
    model = max({c["model"] for c in two}, key=lambda m: sum(c["model"] == m for c in two))
    first = next(c for c in two if c["model"] == model)
    bad = dict(first, precision="fp7", id=first["id"] + "/fp7")
    order = [first, bad] + [c for c in sample if c is not first]
    got = matrix_batch.run_batch(order)
    assert got[bad["id"]]["state"] == "crash" and "fp7" in got[bad["id"]]["error"], got[bad["id"]]
    wrong = []
    for case in sample:
        recorded = records.get(case["id"], {}).get("state")
        want = ("parity",) if recorded == "parity" else ("parity", "refused")
        if got[case["id"]]["state"] not in want:
            wrong.append(f"{case['id']}: {got[case['id']]['state']} ({got[case['id']].get('error', '')}), "
                         f"matrix.json says {recorded}")
    assert not wrong, "\n".join(wrong)
