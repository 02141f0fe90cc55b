"""The arguments users of Lightning's FSDP strategy expect: `activation_checkpointing_policy`
(recomputes those modules: same numbers, fewer saved activations, checkpointed generated code),
`configure_model()` (also on the meta device: a Hugging Face Llama built there on meta and loaded from
a save_pretrained directory with nnscaler.ckpt.load trains as DDP from from_pretrained, under tp2 and
FULL_SHARD, and with its decoder layers as activation_checkpointing_policy under dp2; built on the CPU by
from_pretrained, under dp2, too: its example input gives one tensor as input_ids and labels) and `cpu_offload` (its own tests:
test_lightning_cpu_offload.py)."""
from __future__ import annotations

import pytest
import torch

from launch import run_workers
import sharded_workers

TOL = 1e-5


def _close(a, b, what):
    torch.testing.assert_close(a, b, atol=TOL, rtol=0, msg=lambda m: f"{what}: {m}")


@pytest.mark.multiprocess
def test_activation_checkpointing_recomputes_with_the_same_numbers(tmp_path):
    out = run_workers(sharded_workers.checkpointing, 2, str(tmp_path), timeout=240)[0]
    for name in ("dp2", "tp2"):
        plain, ckpt = out[f"{name}-plain"], out[f"{name}-ckpt"]
        assert plain["code_files"] == ckpt["code_files"] == 2  # one generated forward per rank
        assert plain["checkpoint_calls"] == {0}
        assert ckpt["checkpoint_calls"] == {3}, ckpt["checkpoint_calls"]  # one segment per Linear, on each rank
        # recomputed segments keep only their inputs: fewer tensors saved for backward
        assert ckpt["saved"] < plain["saved"], (ckpt["saved"], plain["saved"])
        _close(ckpt["losses"], plain["losses"], f"{name} losses")
        for key, ref in plain["weights"].items():
            _close(ckpt["weights"][key], ref, f"{name} {key}")
    _close(out["tp2-ckpt"]["losses"], out["dp2-ckpt"]["losses"], "tp2 against dp2")


@pytest.mark.multiprocess
def test_configure_model_and_cpu_offload_match_ddp(tmp_path):
    out = run_workers(sharded_workers.configure_model, 2, str(tmp_path), timeout=240)[0]
    ref_losses, ref_weights = out["ddp"]
    assert len(ref_losses) == 8
    for label in ("cpu", "meta", "offload"):
        losses, weights, built_on, net, devices = out[label]
        assert built_on == ("meta" if label == "meta" else "cpu")
        assert net is None  # the model built in the hook is the one parallelized (and converted)
        assert devices == {"cpu"}  # optimizer state on CPU
        _close(losses, ref_losses, f"{label} losses")
        for key, ref in ref_weights.items():
            _close(weights[key], ref, f"{label} {key}")
    # a Hugging Face Llama built on meta in configure_model, loaded from its save_pretrained
    # directory in on_fit_start (nnscaler.ckpt.load): DDP's training from from_pretrained
    ref_losses, ref_weights = out["llama-ddp"]
    for label in ("llama-tp2", "llama-zero3", "llama-dp2-ckpt", "llama-cpu-dp2"):
        losses, weights, built_on, llama, calls = out[label]
        assert built_on == ("cpu" if label == "llama-cpu-dp2" else "meta") and llama is None, label
        if label == "llama-dp2-ckpt":  # activation_checkpointing_policy={LlamaDecoderLayer}: both layers
            assert calls == [2, 2], calls
        assert calls == {"torch.float32"} or label == "llama-dp2-ckpt", (label, calls)  # the losses' dtypes
        torch.testing.assert_close(losses, ref_losses, atol=1e-6, rtol=TOL, msg=lambda m: f"{label} losses: {m}")
        assert set(ref_weights) <= set(weights), label  # and the rotary buffers
        for key, ref in ref_weights.items():
            assert ((weights[key] - ref).norm() / ref.norm()).item() <= TOL, (label, key)
    # mixed_precision=MixedPrecision(param_dtype=bf16, reduce_dtype=fp32) under FULL_SHARD: computed in bf16
    # (bf16 losses, close to DDP's fp32 ones, not equal), fp32 weights (the shards) close to DDP's
    losses, weights, built_on, llama, dtypes = out["llama-zero3-bf16"]
    assert built_on == "meta" and llama is None and dtypes == {"torch.bfloat16"}, (built_on, dtypes)
    losses = losses.float()
    assert not torch.equal(losses, ref_losses)
    torch.testing.assert_close(losses, ref_losses, atol=0, rtol=2e-2, msg=lambda m: f"bf16 losses: {m}")
    for key, ref in ref_weights.items():
        assert weights[key].dtype == torch.float32 and ((weights[key] - ref).norm() / ref.norm()).item() <= 1e-2, key


def test_sharded_arguments_are_checked():
    from nnscaler.ir import ComputeConfig
    from nnscaler.lightning import NnScalerLightningError, NnScalerStrategy
    from nnscaler.lightning.sharded_args import built_on_meta, check_cpu_offload, recompute_config
    with pytest.raises(NnScalerLightningError, match=r"activation_checkpointing_policy=.*give a set of torch.nn"):
        NnScalerStrategy(activation_checkpointing_policy=lambda m: True)
    with pytest.raises(NnScalerLightningError, match=r"cpu_offload='yes'\): give True or False"):
        NnScalerStrategy(cpu_offload="yes")
    check_cpu_offload(True)  # accepted whatever the device (the offload runs on CUDA and on CPU)
    from nnscaler.lightning.sharded_args import offload_device
    assert offload_device(True) == torch.device("cpu") and offload_device(False) is None
    net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    with pytest.raises(NnScalerLightningError, match=r"Sequential has no submodule of type Conv2d; its submodule "
                                                     r"types: Linear, ReLU"):
        recompute_config(ComputeConfig(1, 1), {torch.nn.Conv2d}, net)
    cfg = recompute_config(ComputeConfig(1, 1, pas_config={"recompute_modules": "h.*"}), {torch.nn.Linear}, net)
    assert cfg.pas_config["recompute_modules"] == ["h.*", "torch.nn.modules.linear.Linear"]
    # FSDP's auto_wrap_policy: use_zero=3's gather units, as qualified classes codegen resolves
    from nnscaler.lightning.sharded_args import wrap_config
    with pytest.raises(NnScalerLightningError, match=r"auto_wrap_policy=.*give a set of torch.nn"):
        NnScalerStrategy(auto_wrap_policy="Linear")
    with pytest.raises(NnScalerLightningError, match=r"auto_wrap_policy=\.\.\.\): Sequential has no submodule of type Conv2d"):
        wrap_config(ComputeConfig(1, 2, use_zero=3), {torch.nn.Conv2d}, net)
    cfg = wrap_config(ComputeConfig(1, 2, use_zero=3), {torch.nn.Linear}, net)
    assert cfg.pas_config["zero3_units"] == ["torch.nn.modules.linear.Linear"] and cfg.zero_stage == 3

    class NoReset(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(2))
    with torch.device("meta"):
        holder = torch.nn.Sequential(torch.nn.Linear(2, 2), NoReset())
    assert built_on_meta(holder) and not built_on_meta(net)
    # what parallelize (which fills a meta-built model on each rank) refuses, naming the module
    from nnscaler.ir import ConfigError
    from nnscaler.runtime.driver.meta_init import check_initializable
    with pytest.raises(ConfigError, match=r"1 \(NoReset\) holds the tensor\(s\) w on the meta device"):
        check_initializable(holder, buffers_only=False)


def test_sharding_strategy_maps_to_use_zero():
    """FSDPStrategy's sharding_strategy, as a name or torch's ShardingStrategy: FULL_SHARD ->
    use_zero=3, SHARD_GRAD_OP -> True, NO_SHARD -> False, HYBRID_SHARD -> 3 with zero_ngroups =
    nodes; a compute_config saying otherwise, an unknown name and one data-parallel rank are refused."""
    from torch.distributed.fsdp import ShardingStrategy
    from nnscaler.ir import ComputeConfig
    from nnscaler.lightning import NnScalerLightningError, NnScalerStrategy
    from nnscaler.lightning.fabric import NnScalerStrategy as FabricStrategy
    from nnscaler.lightning.sharded_args import sharding_config, sharding_strategy_name
    cfg = ComputeConfig(1, 4)
    for given, zero, ngroups in (("FULL_SHARD", 3, 1), (ShardingStrategy.FULL_SHARD, 3, 1), ("shard_grad_op", True, 1),
                                 ("NO_SHARD", False, 1), ("HYBRID_SHARD", 3, 2)):
        out = sharding_config(cfg, sharding_strategy_name(given), num_nodes=2)
        assert out.use_zero == zero and type(out.use_zero) is type(zero) and out.zero_ngroups == ngroups, given
    assert sharding_config(ComputeConfig(1, 4, use_zero=3), "FULL_SHARD", 1).zero_stage == 3
    assert sharding_config(cfg, None, 1) is cfg
    with pytest.raises(NnScalerLightningError, match=r"sharding_strategy='FULL_SHARD'\) means "
                                                     r"ComputeConfig\(use_zero=3\), but compute_config has use_zero=True"):
        sharding_config(ComputeConfig(1, 4, use_zero=True), "FULL_SHARD", 1)
    with pytest.raises(NnScalerLightningError, match=r"one \(plan_ngpus 2 = runtime_ngpus 2\).*or NO_SHARD"):
        sharding_config(ComputeConfig(2, 2), "FULL_SHARD", 1)
    for strategy in (NnScalerStrategy, FabricStrategy):
        with pytest.raises(NnScalerLightningError, match=r"sharding_strategy='ZERO9'\): give one of FULL_SHARD"):
            strategy(sharding_strategy="ZERO9")
        assert strategy(sharding_strategy=ShardingStrategy.HYBRID_SHARD)._sharding == "HYBRID_SHARD"
