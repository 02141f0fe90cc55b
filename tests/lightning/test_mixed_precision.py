"""`nnscaler.lightning.mixed_precision`: FSDPStrategy's ``mixed_precision`` (torch's MixedPrecision,
FSDP2's MixedPrecisionPolicy, or a mapping) -> ``pas_config["zero3_mixed_precision"]``, and its
refusals (fields not taken, bad dtypes, no use_zero=3, a conflicting compute_config). The training
itself: test_lightning_sharded_args.py (a meta-built Llama under FULL_SHARD with bf16 / fp32)."""
from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp import MixedPrecision, MixedPrecisionPolicy

from nnscaler.ir import ComputeConfig
from nnscaler.lightning import NnScalerStrategy
from nnscaler.lightning.errors import NnScalerLightningError
from nnscaler.lightning.mixed_precision import mixed_precision_config, mixed_precision_setting

BF16_FP32 = {"param_dtype": "bfloat16", "reduce_dtype": "float32"}


def test_fsdp_policies_map_to_the_pas_config_entry():
    assert mixed_precision_setting(None) is None
    assert mixed_precision_setting(MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)) == BF16_FP32
    assert mixed_precision_setting(MixedPrecisionPolicy(param_dtype=torch.bfloat16)) == {"param_dtype": "bfloat16"}
    assert mixed_precision_setting({"param_dtype": "bf16", "units": {"lm_head": {"param_dtype": "fp32"}}}) == {
        "param_dtype": "bf16", "units": {"lm_head": {"param_dtype": "fp32"}}}
    cfg = mixed_precision_config(ComputeConfig(1, 2, use_zero=3, pas_config={"zero3_units": "Block"}), BF16_FP32)
    assert cfg.pas_config == {"zero3_units": "Block", "zero3_mixed_precision": BF16_FP32}
    assert mixed_precision_config(cfg, BF16_FP32) == cfg  # given both ways, alike: fine


@pytest.mark.parametrize("policy, match", [
    (MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16), r"MixedPrecision\(buffer_dtype=torch.bfloat16\)\): not supported"),
    (MixedPrecision(keep_low_precision_grads=True), r"keep_low_precision_grads=True"),
    (MixedPrecisionPolicy(output_dtype=torch.float32), r"MixedPrecisionPolicy\(output_dtype=torch.float32\)"),
    (MixedPrecision(param_dtype=torch.int8), r"\['param_dtype'\] is 'int8': give a floating dtype by name"),
    ({"param": "bf16"}, r"unknown key\(s\) 'param'"),
    ("bf16-mixed", r"mixed_precision='bf16-mixed'\): give torch.distributed.fsdp.MixedPrecision, FSDP2's"),
])
def test_bad_policies_are_refused_at_construction(policy, match):
    from nnscaler.lightning.fabric import NnScalerStrategy as FabricStrategy
    for strategy in (NnScalerStrategy, FabricStrategy):
        with pytest.raises(NnScalerLightningError, match=match):
            strategy(mixed_precision=policy)


def test_a_policy_needs_the_fully_sharded_plan_and_one_setting():
    with pytest.raises(NnScalerLightningError, match=r"needs the fully sharded plan: sharding_strategy='FULL_SHARD'.*"
                                                     r"use_zero=True"):
        mixed_precision_config(ComputeConfig(1, 2, use_zero=True), BF16_FP32)
    given = ComputeConfig(1, 2, use_zero=3, pas_config={"zero3_mixed_precision": {"param_dtype": "float16"}})
    with pytest.raises(NnScalerLightningError, match=r"compute_config.pas_config\['zero3_mixed_precision'\] is "
                                                     r"\{'param_dtype': 'float16'\}: give one of the two"):
        mixed_precision_config(given, BF16_FP32)
