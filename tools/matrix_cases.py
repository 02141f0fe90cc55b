"""The compatibility matrix's cases (issue 45 §1): the axes, the full table, the pairwise design.

The table users read is the full product of the *table axes* (model x plan x zero x recompute).
Every cell is one case; its *option axes* (precision, batch, dropout, action, zero_ngroups) are
chosen by a seeded greedy covering design (AETG-like): cells are visited in a seeded order and
each takes, of `CANDIDATES` random valid assignments, the one covering most pairs not yet covered,
so that every valid pair of values of any two axes appears in at least one case. Extra cases
(suffixed ``#2``, ...) are added only for pairs the table's cells could not cover.

`valid_pair` holds the harness's own limits (what the tiny models can be fed): packed documents
only for the models `hf_models` packs, the vision model only with plain batches, zero_ngroups 2
only with ZeRO. Everything else is tried and nnscaler decides: a combination it does not support
must be *refused* with a clear error (a cell state), never assumed here.

Pure Python (no torch): `tools/matrix.py` and the unit tests import it cheaply.
"""
from __future__ import annotations

import itertools
import random
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

SEED = 45
CANDIDATES = 24

MODELS = ("llama", "qwen2", "mistral", "gpt2", "bert", "mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss", "vit")
MOE = ("mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss")
PACKED = ("llama", "mistral", "gpt2")  # hf_models.PACKED (llama as llama64)
VISION = ("vit",)
# plan name -> (policy, plan_ngpus, world size, ComputeConfig extras); a product with dp runs on 4 ranks
PLANS: Dict[str, Tuple[str, int, int, dict]] = {
    "dp": ("dp", 1, 2, {}),
    "tp": ("tp", 2, 2, {}),
    "megatron": ("megatron", 2, 2, {}),
    "pp": ("pp", 2, 2, {"use_end2end": True, "pas_config": {"pipeline_scheduler": "1f1b"}}),
    "pp-interleaved": ("pp", 2, 2, {"use_end2end": True, "pas_config": {"pipeline_scheduler": "1f1b_interleaved"}}),
    "hybrid": ("hybrid", 4, 4, {"use_end2end": True, "pas_config": {"pp_size": 2, "pipeline_nstages": 2,
                                                                     "pipeline_pivots": "<layer>"}}),
    "ep": ("ep", 2, 2, {}),
    "cp": ("cp", 2, 2, {}),
    "autodist": ("autodist", 2, 2, {"pas_config": {"_comm_profile": "<given>"}}),
    "tp x dp": ("tp", 2, 4, {}),
    "megatron x dp": ("megatron", 2, 4, {}),
    "pp x dp": ("pp", 2, 4, {"use_end2end": True, "pas_config": {"pipeline_scheduler": "1f1b"}}),
    "ep x dp": ("ep", 2, 4, {}),
    "cp x dp": ("cp", 2, 4, {}),
    "pp x ep": ("ep", 4, 4, {"use_end2end": True, "pas_config": {"pp_size": 2}}),
    "cp x ep": ("cp", 4, 4, {"pas_config": {"ep_size": 2}}),
}
TABLE_AXES: Dict[str, Tuple] = {
    "model": MODELS,
    "plan": tuple(PLANS),
    "zero": ("none", "1", "3"),
    "recompute": ("off", "layers"),
}
OPTION_AXES: Dict[str, Tuple] = {
    "precision": ("fp32", "bf16", "fp64"),
    "batch": ("plain", "padded", "packed"),
    "dropout": ("off", "exact"),
    "action": ("none", "read", "clip", "accum", "save_load"),
    "zero_ngroups": ("1", "2"),
}
AXES: Dict[str, Tuple] = {**TABLE_AXES, **OPTION_AXES}


def valid_pair(a: str, va: str, b: str, vb: str) -> bool:
    """Whether values `va` of axis `a` and `vb` of axis `b` may appear together (harness limits)."""
    pair = {a: va, b: vb}
    if pair.get("batch") == "packed" and "model" in pair and pair["model"] not in PACKED:
        return False
    if pair.get("model") in VISION and pair.get("batch", "plain") != "plain":
        return False
    if pair.get("zero_ngroups") == "2" and pair.get("zero", "1") == "none":
        return False
    if pair.get("zero_ngroups") == "2" and "plan" in pair and dp_size(pair["plan"]) < 2:
        return False  # zero_ngroups divides the data-parallel size (ComputeConfig refuses it otherwise)
    return True


def dp_size(plan: str) -> int:
    _, plan_ngpus, world, _ = PLANS[plan]
    return world // plan_ngpus


def valid_case(case: Dict[str, str]) -> bool:
    axes = [a for a in AXES if a in case]
    return all(valid_pair(a, case[a], b, case[b]) for a, b in itertools.combinations(axes, 2))


def all_pairs(axes: Sequence[str] = tuple(AXES)) -> set:
    """Every valid pair ((axis, value), (axis, value)) of two of `axes` (axes in AXES order)."""
    axes = [a for a in AXES if a in axes]
    return {((a, va), (b, vb)) for a, b in itertools.combinations(axes, 2)
            for va in AXES[a] for vb in AXES[b] if valid_pair(a, va, b, vb)}


def pairs_of(case: Dict[str, str], axes: Sequence[str] = tuple(AXES)) -> set:
    axes = [a for a in AXES if a in axes and a in case]
    return {((a, case[a]), (b, case[b])) for a, b in itertools.combinations(axes, 2)}


def case_id(case: Dict[str, str]) -> str:
    """A stable, readable id: the table cell, then the options (and ``#n`` for an extra case)."""
    cell = "/".join(case[a] for a in TABLE_AXES)
    opts = ",".join(f"{a}={case[a]}" for a in OPTION_AXES)
    return f"{cell}/{opts}" + (f"#{case['extra']}" if case.get("extra") else "")


# An option nnscaler refuses on its own (the refusal names it): the cell is then run again with
# that option at its baseline, so that the table shows the cell's own state; both are recorded.
OPTION_REFUSALS = {"rng_mode": ("dropout", "off"), "zero_ngroups": ("zero_ngroups", "1"),
                   "with_master_weights": ("precision", "fp32"),
                   "which ring attention does not": ("dropout", "off")}  # cp: attention dropout


def baseline_for(case: Dict[str, str], refusal: str) -> Optional[Dict[str, str]]:
    """The case to run instead when `refusal` (an error's text) names one of `case`'s options."""
    changes = {axis: value for word, (axis, value) in OPTION_REFUSALS.items() if word in refusal}
    if not changes or all(case[a] == v for a, v in changes.items()):
        return None
    base = {a: case[a] for a in AXES}
    base.update(changes)
    if not valid_case(base):
        base["batch"] = "plain"
    base["id"] = case_id(base) + "~base"
    base["base_of"] = case["id"]
    return base


def cell_of(case: Dict[str, str]) -> Tuple[str, ...]:
    return tuple(case[a] for a in TABLE_AXES)


def _options(rng: random.Random, cell: Dict[str, str]) -> Dict[str, str]:
    for _ in range(1000):
        case = dict(cell, **{a: rng.choice(v) for a, v in OPTION_AXES.items()})
        if valid_case(case):
            return case
    raise RuntimeError(f"no valid options for {cell}")  # pragma: no cover - the axes always allow plain


def generate(seed: int = SEED) -> List[Dict[str, str]]:
    """Every case of the matrix (the same list for the same seed): one per table cell, plus extras
    for pairs the cells left uncovered. Each case is a dict axis -> value (and ``id``)."""
    rng = random.Random(seed)
    cells = [dict(zip(TABLE_AXES, values)) for values in itertools.product(*TABLE_AXES.values())]
    order = list(range(len(cells)))
    rng.shuffle(order)
    uncovered = all_pairs()
    chosen: Dict[int, Dict[str, str]] = {}
    for i in order:
        best = max((_options(rng, cells[i]) for _ in range(CANDIDATES)), key=lambda c: len(pairs_of(c) & uncovered))
        chosen[i] = best
        uncovered -= pairs_of(best)
    cases = [chosen[i] for i in range(len(cells))]
    extra = 0
    while uncovered:  # a pair no cell took: one more case built around it
        (a, va), (b, vb) = min(uncovered)
        extra += 1
        base = dict(cases[0], **{a: va, b: vb})
        options = [dict(base, **{x: v}) for x in AXES if x not in (a, b) for v in AXES[x]]
        case = max((c for c in [base] + options if valid_case(c)), key=lambda c: len(pairs_of(c) & uncovered))
        case = dict(case, extra=str(extra))
        cases.append(case)
        uncovered -= pairs_of(case)
    for case in cases:
        case["id"] = case_id(case)
    return cases


def select(cases: Iterable[Dict[str, str]], filters: Optional[Dict[str, Sequence[str]]] = None) -> List[Dict[str, str]]:
    """The cases whose axis values are among `filters` (axis -> allowed values; unknown axes or
    values raise ValueError naming them and the known ones)."""
    filters = {a: list(v) for a, v in (filters or {}).items() if v}
    for axis, values in filters.items():
        if axis not in AXES:
            raise ValueError(f"unknown matrix axis {axis!r}; axes: {', '.join(AXES)}")
        bad = [v for v in values if v not in AXES[axis]]
        if bad:
            raise ValueError(f"unknown value(s) {bad} for --{axis.replace('_', '-')}; values: {', '.join(AXES[axis])}")
    return [c for c in cases if all(c[a] in v for a, v in filters.items())]
