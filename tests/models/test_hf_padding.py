"""Padded batches on real models (HF Llama and BERT decide in Python, from `attention_mask`'s
values, whether to build an attention mask).

- Traced without padding, then fed a padded batch: either every rank raises
  `nnscaler.runtime.GuardError` on that step (naming the model's line), or, when both branches
  were generated, training matches one process.
- Traced with padding, then fed padded and unpadded batches: training matches one process.

Under dp and megatron (2 processes, float64, 3 Adam steps, the bars of test_hf_parity).
"""
from __future__ import annotations

import pytest

import model_plans as mp
from launch import run_workers
from test_hf_parity import TOL, _check

UNPADDED_THEN_PADDED = [False, True, True]
PADDED_THEN_MIXED = [True, False, True]


def _cases(model):
    cases = []
    for make in (mp.dp, mp.megatron):
        base = make()
        cases.append(dict(base, model=model, label=f"{base['label']}-trace-unpadded", trace_pad=False,
                          pad=UNPADDED_THEN_PADDED, guard_ok=True))
        cases.append(dict(base, model=model, label=f"{base['label']}-trace-padded", trace_pad=True,
                          pad=PADDED_THEN_MIXED))
    return cases


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("model", ["llama", "bert"])
def test_padded_batches(model, tmp_path):
    cases = _cases(model)
    results = run_workers(mp.run_plans, 2, cases, str(tmp_path / "gen"), timeout=300)
    matching = []
    for case in cases:
        label = case["label"]
        per_rank = [r[label][0] for r in results]
        guarded = [losses[-1] for losses in per_rank if losses and isinstance(losses[-1], tuple)]
        if case.get("guard_ok") and guarded:
            # the guard fired: on every rank, at the first padded step, naming the user's line
            assert len(guarded) == len(per_rank), f"{label}: only some ranks raised GuardError: {per_rank}"
            assert all(len(losses) == 1 + UNPADDED_THEN_PADDED.index(True) for losses in per_rank), per_rank
            for _, message in guarded:
                assert "masking_utils.py" in message or "modeling_" in message, message
            ref_losses, _ = mp.reference(model, pad=UNPADDED_THEN_PADDED)
            first = UNPADDED_THEN_PADDED.index(True)
            for got, want in zip(per_rank[0][:first], ref_losses[:first]):
                assert abs(got - want) <= TOL * max(1.0, abs(want))
        else:
            matching.append(case)
    _check(results, matching)
