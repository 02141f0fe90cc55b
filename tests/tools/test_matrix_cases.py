"""tools/matrix_cases.py: the full table, the pairwise covering design (it really covers every
valid pair, and only valid cases are made), seeded and stable, filters (CI's sample: test_matrix_sample.py)."""
from __future__ import annotations

import itertools
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))

import matrix_cases as mc  # noqa: E402


@pytest.fixture(scope="module")
def cases():
    return mc.generate()


def test_every_table_cell_is_a_case_once(cases):
    cells = [mc.cell_of(c) for c in cases if not c.get("extra")]
    assert len(cells) == len(set(cells)) == len(list(itertools.product(*mc.TABLE_AXES.values())))
    assert len({c["id"] for c in cases}) == len(cases)


def test_every_valid_pair_of_any_two_axes_is_covered(cases):
    covered = set().union(*(mc.pairs_of(c) for c in cases))
    assert mc.all_pairs() <= covered, sorted(mc.all_pairs() - covered)[:5]
    assert all(mc.valid_case(c) for c in cases)
    # the harness limits are real limits: no packed batch for BERT, no padding for the vision model
    assert not any(c["batch"] == "packed" and c["model"] not in mc.PACKED for c in cases)
    assert not any(c["model"] == "vit" and c["batch"] != "plain" for c in cases)
    assert not any(c["zero"] == "none" and c["zero_ngroups"] == "2" for c in cases)
    assert not any(mc.dp_size(c["plan"]) < 2 and c["zero_ngroups"] == "2" for c in cases)


def test_seeded_and_stable(cases):
    assert [c["id"] for c in mc.generate()] == [c["id"] for c in cases]
    other = mc.generate(seed=mc.SEED + 1)
    assert [c["id"] for c in other] != [c["id"] for c in cases]
    assert mc.all_pairs() <= set().union(*(mc.pairs_of(c) for c in other))


def test_filters(cases):
    picked = mc.select(cases, {"model": ["llama"], "plan": ["cp", "cp x dp"]})
    assert picked and all(c["model"] == "llama" and c["plan"] in ("cp", "cp x dp") for c in picked)
    assert len(picked) == 2 * len(mc.TABLE_AXES["zero"]) * len(mc.TABLE_AXES["recompute"])
    assert mc.select(cases, {"model": []}) == cases
    with pytest.raises(ValueError, match="unknown value.*'lama'.*--model.*llama"):
        mc.select(cases, {"model": ["lama"]})
    with pytest.raises(ValueError, match="unknown matrix axis 'modle'"):
        mc.select(cases, {"modle": ["llama"]})
