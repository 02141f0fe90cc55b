"""CI's sample of the compatibility matrix (issue 45 §2): a fixed, seeded subset of the full
matrix's cases with two-way coverage: every valid pair of values of any two axes (model, plan,
zero, recompute, precision, batch, dropout, action, zero_ngroups) appears in at least one case.

*Valid* means a combination nnscaler trains: a pair counts when some case of the full matrix
holding it trains (is recorded ``parity`` in bench/results/matrix.json, or has no record yet).
A pair that only refused cases hold (say BERT x ep: no experts to place) is a refusal, quick and
listed in docs/compatibility.md, not a pair to cover; a pair only failing cases hold (crash, hang,
differs) is a known failure, listed there too. `coverage` says how many pairs of each kind there
are. The harness's own limits (`matrix_cases.valid_pair`) come first: a pair they forbid is
never made.

The sample is picked from those training cases (and the recorded baseline reruns of refused
options) by greedy weighted set cover: most uncovered pairs per second of the case's recorded
time (`ESTIMATE` for a case without a record), seeded tie-break, then every case whose pairs the
others already cover is dropped again, dearest first. It is a function of the seed and the
results file: fixed for a commit; a new full run may change it. `tests/tools/test_matrix_sample.py`
checks the coverage (computed, not listed) and runs the sample (multiprocess).

Pure Python (no torch).
"""
from __future__ import annotations

import random
from typing import Dict, List, Optional, Sequence, Tuple

import matrix_cases as mc

ESTIMATE = {2: 2.0, 4: 3.0}  # seconds a case without a record is taken to cost, by world size
FAILED = ("crash", "hang", "differs")


def candidates(records: Dict[str, dict], cases: Optional[Sequence[dict]] = None) -> List[dict]:
    """The full matrix's cases, then the recorded baseline reruns (``~base``) as cases."""
    cases = list(mc.generate() if cases is None else cases)
    known = {c["id"] for c in cases}
    for cid, rec in sorted(records.items()):
        if cid not in known and rec.get("base_of") and rec.get("case"):
            cases.append(dict(rec["case"], id=cid, base_of=rec["base_of"]))
    return cases


def trains(case: dict, records: Dict[str, dict]) -> bool:
    """Whether `case` is a training case: recorded parity, or not run yet (a generated case)."""
    state = records.get(case["id"], {}).get("state")
    return state == "parity" or (state is None and not case.get("base_of"))


def cost(case: dict, records: Dict[str, dict]) -> float:
    rec = records.get(case["id"])
    world = mc.PLANS[case["plan"]][2]
    return max(0.5, float(rec["seconds"])) if rec and rec.get("seconds") is not None else ESTIMATE[world]


def coverage(records: Dict[str, dict], cases: Optional[Sequence[dict]] = None) -> Dict[str, set]:
    """The valid pairs of the matrix by kind: ``train`` (held by a training case: CI covers
    them), ``refused`` (held only by refused cases), ``failed`` (held by no training case and by a
    failing one), ``unheld`` (valid for the harness, held by no case: the design covers every one,
    so this is empty)."""
    cases = candidates(records, cases)
    train = set().union(*(mc.pairs_of(c) for c in cases if trains(c, records)))
    failed = set().union(*(mc.pairs_of(c) for c in cases if records.get(c["id"], {}).get("state") in FAILED))
    held = set().union(*(mc.pairs_of(c) for c in cases))
    valid = mc.all_pairs()
    return {"train": train & valid, "failed": (failed - train) & valid,
            "refused": (held - train - failed) & valid, "unheld": valid - held}


def ci_sample(records: Dict[str, dict], cases: Optional[Sequence[dict]] = None, seed: int = mc.SEED) -> List[dict]:
    """CI's sample: training cases covering every pair of `coverage(...)["train"]`, cheap ones
    first (see the module's docstring); in the candidates' order."""
    pool = [c for c in candidates(records, cases) if trains(c, records)]
    rng = random.Random(seed)
    rng.shuffle(pool)
    costs = {c["id"]: cost(c, records) for c in pool}
    pairs = {c["id"]: frozenset(mc.pairs_of(c)) for c in pool}
    uncovered = set().union(*pairs.values()) if pool else set()
    picked: List[dict] = []
    while uncovered:
        best = max(pool, key=lambda c: len(pairs[c["id"]] & uncovered) / costs[c["id"]])
        picked.append(best)
        uncovered -= pairs[best["id"]]
    for case in sorted(picked, key=lambda c: -costs[c["id"]]):  # drop what the others cover
        others = [c for c in picked if c is not case]
        if pairs[case["id"]] <= set().union(*(pairs[c["id"]] for c in others)):
            picked = others
    order = {c["id"]: i for i, c in enumerate(candidates(records, cases))}
    return sorted(picked, key=lambda c: order[c["id"]])


def summary(sample: Sequence[dict], records: Dict[str, dict]) -> Tuple[int, float]:
    """(cases, their recorded or estimated seconds in all)."""
    return len(sample), round(sum(cost(c, records) for c in sample), 1)
