"""`contracts.mixed_precision`: ``pas_config["zero3_mixed_precision"]`` read into typed per-unit
policies (FSDP2's MixedPrecisionPolicy names), and its refusals naming the culprit."""
from __future__ import annotations

import pytest
import torch

from nnscaler.ir.contracts.shard_precision import MixedPrecision, UnitPrecision, mixed_precision
from nnscaler.ir.errors import ConfigError

BF16, FP32 = torch.bfloat16, torch.float32


def test_policy_per_unit_and_defaults():
    assert mixed_precision(None) == mixed_precision({}) == MixedPrecision() and not MixedPrecision().active
    policy = mixed_precision({"param_dtype": "bfloat16", "reduce_dtype": "fp32",
                              "units": {"lm_head": {"reduce_dtype": "bf16"}, "model.layers.*": {"param_dtype": None},
                                        "model.layers.1": {"param_dtype": "float16"}}})
    assert policy.active
    assert policy.for_unit("model.embed_tokens") == UnitPrecision(BF16, FP32)
    assert policy.for_unit("lm_head") == UnitPrecision(BF16, BF16)  # a unit's entry inherits the rest
    assert policy.for_unit("model.layers.1") == UnitPrecision(None, FP32)  # the first matching entry decides
    assert policy.for_unit("") == UnitPrecision(BF16, FP32)  # the root
    assert mixed_precision({"param_dtype": "torch.float32"}).for_unit("x") == UnitPrecision(FP32, None)


def test_dtypes_a_unit_is_gathered_and_reduced_in():
    bf16 = UnitPrecision(BF16)
    assert (bf16.gather_dtype(FP32), bf16.reduce_in(FP32)) == (BF16, BF16)  # FSDP2: reduce_dtype defaults to param's
    assert UnitPrecision(BF16, FP32).reduce_in(FP32) == FP32
    assert (UnitPrecision().gather_dtype(FP32), UnitPrecision().reduce_in(torch.float64)) == (FP32, torch.float64)
    assert bf16.gather_dtype(torch.int64) == torch.int64  # a non-floating shard keeps its dtype


@pytest.mark.parametrize("setting, match", [
    ({"param_dtype": "int8"}, r"\['param_dtype'\] is 'int8': give a floating dtype by name, one of float32"),
    ({"param_dtype": torch.bfloat16}, r"\['param_dtype'\] is torch.bfloat16: give a floating dtype by name"),
    ({"param_dtpe": "bf16"}, r"unknown key\(s\) 'param_dtpe': the keys are param_dtype, reduce_dtype, units"),
    ({"buffer_dtype": "bf16"}, r"unknown key\(s\) 'buffer_dtype'.*buffers keep their dtype"),
    ("bf16", r"is 'bf16': give a mapping of param_dtype, reduce_dtype, units"),
    ({"units": {"lm_head": {"units": {}}}}, r"\['units'\]\['lm_head'\] has unknown key\(s\) 'units'"),
    ({"units": {"lm_head": {"reduce_dtype": "fp8"}}}, r"\['units'\]\['lm_head'\]\['reduce_dtype'\] is 'fp8'"),
    ({"units": ["lm_head"]}, r"\['units'\] is \['lm_head'\]: give a mapping of unit names or globs"),
])
def test_bad_settings_name_the_culprit(setting, match):
    with pytest.raises(ConfigError, match=r"pas_config\['zero3_mixed_precision'\]" + ".*" + match):
        mixed_precision(setting)


def test_a_policy_needs_use_zero_3_for_training():
    for stage, inference in ((0, False), (1, False), (3, True)):
        with pytest.raises(ConfigError, match=r"needs ComputeConfig\(use_zero=3\) for training.*precision"):
            mixed_precision({"param_dtype": "bf16"}, stage, inference)
    mixed_precision({"param_dtype": None}, 0)  # no policy: nothing to refuse


def test_compute_config_checks_the_setting():
    from nnscaler.ir import ComputeConfig
    ComputeConfig(1, 2, use_zero=3, pas_config={"zero3_mixed_precision": {"param_dtype": "bf16"}})
    with pytest.raises(ConfigError, match=r"needs ComputeConfig\(use_zero=3\) for training"):
        ComputeConfig(1, 2, use_zero=True, pas_config={"zero3_mixed_precision": {"param_dtype": "bf16"}})
    with pytest.raises(ConfigError, match=r"\['reduce_dtype'\] is 'float8'"):
        ComputeConfig(1, 2, use_zero=3, pas_config={"zero3_mixed_precision": {"reduce_dtype": "float8"}})
