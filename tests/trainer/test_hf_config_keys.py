"""`nnscaler.trainer.hf.config_keys`: checks of a transformers config before any worker starts, on
examples/trainer/hf_moe.yaml (no process launched).

- a key of ``model.args.config`` that the config class does not read (stored in config.json and
  ignored) is a TrainerConfigWarning naming it: our own options (``capacity_factor``) name
  ``model.args.<key>``, a typo its close matches; the example, and the fields every tested family's
  config writes, warn nothing;
- Mixtral's ``router_jitter_noise`` (train-mode-only noise) is refused in a run that validates,
  naming the fixes, and accepted without validation.
"""
from __future__ import annotations

import warnings

import pytest

from nnscaler.trainer import TrainerConfigError, TrainerConfigWarning
from nnscaler.trainer.hf.config_keys import unread_config_keys

transformers = pytest.importorskip("transformers")


def _example(*overrides):
    from hf_runs import example_args
    return example_args("hf_moe.yaml", *overrides)


def _warnings(*overrides):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _example(*overrides)
    return [str(w.message) for w in caught if issubclass(w.category, TrainerConfigWarning)]


def test_the_example_warns_nothing():
    assert _warnings() == []


def test_our_option_in_the_model_config_is_a_warning_naming_where_it_goes():
    [said] = _warnings("--model.args.config.capacity_factor", "1.25")
    assert said.startswith("model.args.config.capacity_factor: transformers' MixtralConfig does not read "
                           "'capacity_factor'"), said
    assert "ignored by the model" in said and "--model.args.capacity_factor 1.25" in said


def test_a_misspelt_key_is_a_warning_with_the_close_match():
    [said] = _warnings("--model.args.config.num_experts_per_token", "2")
    assert "model.args.config.num_experts_per_token" in said and "did you mean num_experts_per_tok" in said


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "gpt_oss", "llama",
                                        "mistral", "gpt2", "qwen2", "olmoe"])
def test_every_field_a_config_writes_is_read(model_type):
    fields = transformers.CONFIG_MAPPING[model_type]().to_dict()
    assert unread_config_keys(fields) == []
    assert unread_config_keys(dict(fields, capacity_factor=1.0)) == ["capacity_factor"]


def test_router_jitter_noise_is_refused_when_the_run_validates():
    with pytest.raises(TrainerConfigError) as e:
        _example("--model.args.config.router_jitter_noise", "0.1")
    said = str(e.value)
    assert e.value.key == "model.args.config" and "router_jitter_noise is 0.1" in said, said
    assert "--model.args.config.router_jitter_noise 0" in said and "remove dataset.val_args" in said
    _example("--model.args.config.router_jitter_noise", "0.1", "--dataset.val_args!")  # no validation: trains
