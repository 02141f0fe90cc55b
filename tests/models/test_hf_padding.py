"""Padded and packed batches on real models (HF Llama, Qwen2, Mistral and BERT decide in Python,
from `attention_mask`'s values, whether to build an attention mask; without a mask, from
`position_ids`, whether documents are packed).

- Traced without padding, then fed right- and left-padded batches: either every rank raises
  `nnscaler.runtime.GuardError` on that step (naming the model's line), or, when both branches
  were generated, training matches one process. Under `tp` both branches must be generated and
  match: each branch's ops are split along dims of their own, and a size read of a value that
  differs between the branches was scaled by the traced side's layout (issue 45: SDPA's output
  reshaped with the heads' size as the batch's, the loss 6e-3 off one process, or a crash).
- Traced with padding, then fed padded (right, left) and unpadded batches: training matches
  one process.
- DeepSeek-V3 under tp (its attention fills a `new_empty` key through slices, `copy_`): tp keeps
  that write, its views and their base replicated; split, the write went into a converted copy
  and the attention read uninitialised memory (4e-5 off one process at the first, unpadded step).
- Llama, Mistral (and GPT-2 under megatron) fed packed documents (`position_ids` restarting, no
  mask), traced unpacked: training matches one process (each document attends to itself only).

- Pipelined, traced unpadded, fed micro-batches that take different branches in one step (one
  padded or packed, the other not; the data-parallel replicas differ too): every stage follows the
  branch its micro-batch took (the decision is sent on with the activations) and training matches
  one process, under pp 2 x dp 2 (1F1B: Qwen2, GPT-2 packed; interleaved 1F1B: Llama) and pp 4
  alone (1F1B, Qwen2). Before, a pipelined plan kept the traced branch, and the first padded
  micro-batch raised GuardError (the compatibility matrix's `pp x dp` crashes).

Under dp, megatron and tp (2 processes) and tp 2 x dp 2 with ZeRO-1 (4 processes), float64,
3 Adam steps, the bars of test_hf_parity. One launch per plan, looping over the models (the
pipelined cases share one launch of 4 processes).
"""
from __future__ import annotations

import pytest

import model_plans as mp
from launch import run_workers
from test_hf_parity import TOL, _check

UNPADDED_THEN_PADDED = [False, True, "left"]
PADDED_THEN_MIXED = [True, False, "left"]
# plan -> (models, guards allowed: the plan may keep the traced branch and raise GuardError)
PLANS = {"dp": (["llama", "bert"], True), "megatron": (["llama", "bert"], True),
         "tp": (["llama64", "qwen2", "mistral", "gpt2", "bert", "deepseek_v3"], False)}
TRACE_PADDED_TOO = {"dp": ["llama", "bert"], "megatron": ["llama", "bert"], "tp": ["llama64"]}
UNPACKED_THEN_PACKED = [False, True, True]
PACKED = {"dp": [], "megatron": ["gpt2_packed"], "tp": ["llama64_packed", "mistral_packed"]}


def _cases(plan):
    models, guard_ok = PLANS[plan]
    base = getattr(mp, plan)()
    cases = []
    for model in models:
        cases.append(dict(base, model=model, label=f"{model}-{base['label']}-trace-unpadded", trace_pad=False,
                          pad=UNPADDED_THEN_PADDED, guard_ok=guard_ok))
        if model in TRACE_PADDED_TOO[plan]:
            cases.append(dict(base, model=model, label=f"{model}-{base['label']}-trace-padded", trace_pad=True,
                              pad=PADDED_THEN_MIXED))
    for model in PACKED[plan]:
        cases.append(dict(base, model=model, label=f"{model}-{base['label']}-trace-unpacked", trace_pad=False,
                          pad=UNPACKED_THEN_PACKED))
    return cases


def _check_guarded_or_matching(results, cases):
    matching = []
    for case in cases:
        label, model = case["label"], case["model"]
        per_rank = [r[label][0] for r in results]
        guarded = [losses[-1] for losses in per_rank if losses and isinstance(losses[-1], tuple)]
        if case.get("guard_ok") and guarded:
            # the guard fired: on every rank, at the first padded step, naming the user's line
            assert len(guarded) == len(per_rank), f"{label}: only some ranks raised GuardError: {per_rank}"
            first = [bool(p) for p in UNPADDED_THEN_PADDED].index(True)
            assert all(len(losses) == 1 + first for losses in per_rank), per_rank
            for _, message in guarded:
                assert "masking_utils.py" in message or "modeling_" in message, message
            ref_losses, _ = mp.reference(model, pad=UNPADDED_THEN_PADDED)
            for got, want in zip(per_rank[0][:first], ref_losses[:first]):
                assert abs(got - want) <= TOL * max(1.0, abs(want))
        else:
            matching.append(case)
    _check(results, matching)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("plan", list(PLANS))
def test_padded_batches(plan, tmp_path):
    cases = _cases(plan)
    results = run_workers(mp.run_plans, 2, cases, str(tmp_path / "gen"), timeout=600)
    _check_guarded_or_matching(results, cases)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_padded_batches_tp2_dp2_zero1(tmp_path):
    """tp over 2 ranks x 2 data-parallel replicas with ZeRO-1, traced unpadded, fed padded batches."""
    cases = [dict(mp.tp(use_zero=True), model="llama64", label="llama64-tp2-dp2-zero1-trace-unpadded",
                  trace_pad=False, pad=UNPADDED_THEN_PADDED)]
    results = run_workers(mp.run_plans, 4, cases, str(tmp_path / "gen"), timeout=600)
    _check(results, cases)


# micro-batches of one sample under pp 2 x dp 2 (two under pp 4): True pads (packs) every odd sample, so
# each step's first micro-batch is unpadded and its second padded; "last" pads one replica's second only
MIXED_MICROS = [True, "last", "left"]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_pipelined_micro_batches_taking_different_branches(tmp_path):
    interleaved = mp.pp()
    interleaved["cfg"] = dict(interleaved["cfg"], pas_config=dict(interleaved["cfg"]["pas_config"],
                                                                   pipeline_scheduler="1f1b_interleaved"))
    pp4 = mp.plan("pp4", "pp", 4, use_end2end=True, pas_config=mp.pp()["cfg"]["pas_config"])
    cases = [dict(mp.pp(), model="qwen2", label="qwen2-pp2-dp2-mixed", trace_pad=False, pad=MIXED_MICROS),
             dict(mp.pp(), model="gpt2_packed", label="gpt2-packed-pp2-dp2-mixed", trace_pad=False,
                  pad=[True, True, False]),
             dict(interleaved, model="llama64", label="llama64-pp2i-dp2-mixed", trace_pad=False, pad=MIXED_MICROS),
             dict(pp4, model="qwen2", label="qwen2-pp4-mixed", trace_pad=False, pad=MIXED_MICROS)]
    results = run_workers(mp.run_plans, 4, cases, str(tmp_path / "gen"), timeout=900)
    _check(results, cases)
