"""trainer/meta_build.py: the Trainer builds `hf.CausalLM` on the meta device whenever the plan shards
parameters (``use_zero: 3``, ``plan_ngpus > 1``), with ``pretrained`` or without; without, each rank
initializes what it holds (runtime/driver/meta_init.py `initial_values`), which equals building on the
CPU with the same seed; where that replay would differ (GPT-2's Conv1D, a model built in another dtype
than the one asked for) `CausalLM` builds on the CPU with a one-line note."""
from __future__ import annotations

import logging

import pytest
import torch

from hf_runs import example_args
from nnscaler.runtime.driver.meta_init import initial_values
from nnscaler.trainer.hf import CausalLM
from nnscaler.trainer.meta_build import builds_on_meta, cpu_init_needed

transformers = pytest.importorskip("transformers")

LLAMA = dict(model_type="llama", vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
GPT2 = dict(model_type="gpt2", vocab_size=64, n_embd=16, n_layer=2, n_head=2, n_positions=32)
MIXTRAL = dict(model_type="mixtral", vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
               num_attention_heads=2, num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2,
               max_position_embeddings=32)


@pytest.mark.parametrize("plan, pretrained, tracing, want", [
    ([], False, False, False),                                               # unsharded: the CPU build, unchanged
    ([], True, False, False),
    (["--compute_config.use_zero", "3"], False, False, True),                # sharded, initialized on the ranks
    (["--compute_config.use_zero", "3"], True, False, True),
    (["--pas_policy", "tp", "--compute_config.plan_ngpus", "2"], False, False, True),
    (["--compute_config.use_zero", "3"], False, True, False),                # tracing_from_weights loads into it
])
def test_the_trainer_builds_on_meta_when_the_plan_shards_parameters(tmp_path, plan, pretrained, tracing, want):
    extra = (["--model.args.pretrained", str(tmp_path)] if pretrained else []) + \
        (["--tracing_from_weights", str(tmp_path / "w.safetensors")] if tracing else [])
    args = example_args("hf_llama.yaml", "--compute_config.runtime_ngpus", "2", *plan, *extra)
    assert builds_on_meta(CausalLM, args) is want


def test_a_mixture_of_experts_without_pretrained_is_built_on_the_cpu():
    # transformers' router counts run histc in int32 on meta, which the CPU cannot: not traced on meta
    args = example_args("hf_moe.yaml", "--compute_config.runtime_ngpus", "2", "--compute_config.use_zero", "3")
    assert builds_on_meta(CausalLM, args) is False


def _initial(config, dtype=torch.float32):
    """(the CPU build's state, `cpu_init_needed` of the meta build, the values replayed into it cast to
    `dtype`) from seed 3."""
    cfg = transformers.AutoConfig.for_model(**config)
    torch.manual_seed(3)
    cpu = transformers.AutoModelForCausalLM.from_config(cfg).to(dtype)
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(cfg)
    why = cpu_init_needed(meta, dtype)
    torch.manual_seed(3)
    got = {}
    for values in initial_values(meta.to(dtype)):
        got.update({n: v.clone() for n, v in values.items()})
    return cpu.state_dict(), why, got


@pytest.mark.parametrize("config", [LLAMA, MIXTRAL], ids=["llama", "mixtral"])
def test_replayed_initialisation_equals_the_cpu_build(config):
    want, why, got = _initial(config)
    assert why is None
    assert set(want) <= set(got) and all(torch.equal(got[n], want[n]) for n in want)


def test_what_cannot_be_replayed_is_named_and_built_on_the_cpu(caplog):
    want, why, got = _initial(GPT2)  # Conv1D draws in __init__: the replayed stream is another one
    assert not all(torch.equal(got[n], want[n]) for n in want if n in got)
    assert "Conv1D" in why
    want, why, got = _initial(LLAMA, torch.float64)  # a float64 draw is not a float32 draw cast
    assert not torch.equal(got["model.embed_tokens.weight"], want["model.embed_tokens.weight"])
    assert "float32" in why
    with caplog.at_level(logging.WARNING), torch.device("meta"):
        gpt2 = CausalLM(config=GPT2)
        llama64 = CausalLM(config=LLAMA, dtype="float64")
        llama = CausalLM(config=LLAMA)
    assert not any(p.is_meta for p in (*gpt2.parameters(), *llama64.parameters()))
    assert all(p.is_meta for p in llama.parameters())
    notes = [r.getMessage() for r in caplog.records if "not on the meta device" in r.getMessage()]
    assert len(notes) == 2 and "Conv1D" in notes[0] and "float64" in notes[1], notes
    torch.manual_seed(5)
    cpu = CausalLM(config=GPT2).state_dict()
    with torch.device("meta"):
        torch.manual_seed(5)
        again = CausalLM(config=GPT2).state_dict()
    assert all(torch.equal(cpu[n], again[n]) for n in cpu)  # the fallback is the CPU build's values
