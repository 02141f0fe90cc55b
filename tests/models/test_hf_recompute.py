"""Activation recomputation of transformers models (issue 43 §1): `pas_config["recompute_modules"]`
naming the decoder layers of HF Llama, Qwen2, Mistral, GPT-2 and Mixtral trains like one process in
float64 (every loss and every parameter after 3 Adam steps within 1e-10) under every plan: dp, ZeRO-1,
ZeRO-3, tp, pp, ep and cp, one spawn of 2 processes for all of them.

The attention mask is made in a branch of a decision on the data (transformers' "is anything
padded?"), outside the recomputed layers, which read it: the batches switch between padded and
unpadded steps, and under dp between ranks (``pad="last"``: one rank's slice padded, the other's
not), so every plan runs both branches inside its recomputed layers. (Without an attention mask the
decision is transformers' packed-sequence check: the Trainer's and Lightning's recomputation tests
run that way.) A pipelined plan keeps the
traced branch (its guard checks it), so pp runs unpadded batches. Every rank's generated code
checkpoints each layer it holds (a layer cut between pipeline stages: a segment on each).
"""
from __future__ import annotations

import glob

import pytest

import model_plans as mp
from launch import run_workers
from test_hf_parity import _check

LAYERS = {"llama": "LlamaDecoderLayer", "llama64": "LlamaDecoderLayer", "qwen2": "Qwen2DecoderLayer",
          "mistral": "MistralDecoderLayer", "gpt2": "GPT2Block", "mixtral": "MixtralDecoderLayer"}


def _case(label, model, policy, plan, pad, trace_pad, **cfg):
    pas = dict(cfg.pop("pas_config", {}), recompute_modules=LAYERS[model])
    return dict(mp.plan(label, policy, plan, pad=pad, pas_config=pas, **cfg), model=model, trace_pad=trace_pad)


CASES = [
    _case("llama-dp", "llama", "dp", 1, ["last", True, False], False),
    _case("gpt2-zero1", "gpt2", "dp", 1, [True, "last", False], True, use_zero=True),
    _case("mistral-zero3", "mistral", "dp", 1, ["last", False, True], True, use_zero=3),
    _case("qwen2-tp", "qwen2", "tp", 2, [False, True, True], False),
    _case("qwen2-pp", "qwen2", "pp", 2, False, False, use_end2end=True,
          pas_config={"pipeline_nmicros": mp.NMICROS, "pipeline_scheduler": "1f1b"}),
    _case("mixtral-ep", "mixtral", "ep", 2, [False, True, False], False),
    _case("llama64-cp", "llama64", "cp", 2, [True, False, True], True),
]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_recomputed_decoder_layers_train_like_one_process_under_every_plan(tmp_path):
    gen_root = tmp_path / "gen"
    results = run_workers(mp.run_plans, 2, CASES, str(gen_root), timeout=400)
    _check(results, CASES)
    for case in CASES:
        code = [open(p).read() for p in glob.glob(str(gen_root / case["label"] / "**" / "gencode*.py"), recursive=True)]
        calls = [c.count("torch.utils.checkpoint.checkpoint(") for c in code]
        if case["policy"] == "pp":  # the stages split the layers (a layer cut between stages: a segment on each)
            assert len(calls) == 2 and min(calls) >= 1 and sum(calls) >= 2, (case["label"], calls)
        else:  # one segment per layer on every rank
            assert calls == [2, 2], (case["label"], calls)
