"""Every configuration NnScalerStrategy refuses, each with its message (an NnScalerError naming
the user's thing and the fix); the in-process ones here, the ones that need a Trainer.fit on
real gloo ranks through refusal_workers."""
from __future__ import annotations

import pytest
import torch

from nnscaler.ir import NnScalerError


def test_import_registers_the_strategy_names():
    import nnscaler.lightning  # noqa: F401
    from lightning.pytorch.strategies import StrategyRegistry
    from nnscaler.lightning import NnScalerStrategy
    for name, method in (("nnscaler", "popen"), ("nnscaler_spawn", "spawn"), ("nnscaler_fork", "fork")):
        assert StrategyRegistry[name]["strategy"] is NnScalerStrategy
        assert StrategyRegistry[name]["init_params"] == {"start_method": method}


def test_bad_constructor_arguments():
    from nnscaler.lightning import NnScalerStrategy
    with pytest.raises(NnScalerError, match=r"state_dict_type='merged'.*'sharded' or 'deduped'"):
        NnScalerStrategy(state_dict_type="merged")
    with pytest.raises(NnScalerError, match=r"compute_config=\.\.\.\) must be a nnscaler ComputeConfig, got dict"):
        NnScalerStrategy(compute_config={"plan_ngpus": 1})
    with pytest.raises(NnScalerError, match=r"checkpoint_io=\.\.\.\) is not supported"):
        from lightning.pytorch.plugins import TorchCheckpointIO
        NnScalerStrategy(checkpoint_io=TorchCheckpointIO())


def test_unsupported_precision_is_refused():
    import lightning.pytorch as pl
    from nnscaler.lightning import NnScalerPrecision, NnScalerStrategy
    from nnscaler.lightning.grad_scaler import NnScalerGradScaler
    with pytest.raises(NnScalerError, match=r"precision plugin DoublePrecision \(precision='64-true'\).*32-true"):
        pl.Trainer(strategy=NnScalerStrategy(), precision="64-true", accelerator="cpu", devices=1, logger=False)
    with pytest.raises(NnScalerError, match=r"NnScalerPrecision\('64-true'\) is not supported; use one of"):
        NnScalerPrecision("64-true")
    with pytest.raises(NnScalerError, match=r"only '16-mixed' and '16-true' use a grad scaler"):
        NnScalerPrecision("bf16-mixed", scaler=torch.amp.GradScaler("cpu"))
    t = pl.Trainer(strategy=NnScalerStrategy(), precision="32-true", accelerator="cpu", devices=1, logger=False,
                   enable_checkpointing=False)
    assert isinstance(t.strategy.precision_plugin, NnScalerPrecision)
    for name in ("bf16-mixed", "bf16-true", "16-true"):  # Lightning's plugins of the supported kinds become ours
        t = pl.Trainer(strategy=NnScalerStrategy(), precision=name, accelerator="cpu", devices=1, logger=False,
                       enable_checkpointing=False)
        assert isinstance(t.strategy.precision_plugin, NnScalerPrecision)
        assert t.strategy.precision_plugin.precision == name
        assert (t.strategy.precision_plugin.scaler is not None) == (name == "16-true")
    # a Lightning MixedPrecision plugin's scaler settings are kept in ours
    from lightning.pytorch.plugins.precision import MixedPrecision
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=3))
    t = pl.Trainer(strategy=NnScalerStrategy(), plugins=[plugin], accelerator="cpu", devices=1, logger=False,
                   enable_checkpointing=False)
    scaler = t.strategy.precision_plugin.scaler
    assert isinstance(scaler, NnScalerGradScaler)
    assert scaler.get_scale() == 8.0 and scaler.get_growth_interval() == 3


def test_fabric_precision_plugins():
    import lightning.fabric as lf
    from nnscaler.lightning.fabric import NnScalerPrecision, NnScalerStrategy
    with pytest.raises(NnScalerError, match=r"precision plugin DoublePrecision \(precision='64-true'\)"):
        lf.Fabric(strategy=NnScalerStrategy(), precision="64-true", accelerator="cpu", devices=1)
    for name in ("bf16-mixed", "16-true"):  # Fabric's plugins of the supported kinds become ours
        fabric = lf.Fabric(strategy=NnScalerStrategy(), precision=name, accelerator="cpu", devices=1)
        assert isinstance(fabric.strategy.precision, NnScalerPrecision)
        assert fabric.strategy.precision.precision == name
        assert (fabric.strategy.precision.scaler is not None) == (name == "16-true")


def test_lightning_state_round_trips_through_json():
    from nnscaler.lightning.state_codec import decode, encode
    from nnscaler.lightning import NnScalerLightningError
    state = {"epoch": 3, "t": (1, 2), "inf": float("inf"), 1: "int key", "dtype": torch.float16,
             "nested": [{"x": torch.ones(2)}]}
    back = decode(encode(state))
    assert back["t"] == (1, 2) and back["inf"] == float("inf") and back[1] == "int key"
    assert back["dtype"] is torch.float16 and torch.equal(back["nested"][0]["x"], torch.ones(2))
    with pytest.raises(NnScalerLightningError, match=r"holds a object at '/hyper_parameters/thing'"):
        encode({"hyper_parameters": {"thing": object()}})


@pytest.mark.multiprocess
def test_refused_configurations_in_fit(tmp_path):
    from launch import run_workers
    import refusal_workers
    out = run_workers(refusal_workers.refusals, 2, str(tmp_path), timeout=180)
    expected = {
        "two_optimizers": r"TwoOptimizers.configure_optimizers returned 2 optimizers; NnScalerStrategy supports one",
        "two_schedulers": r"returned 2 LR schedulers; NnScalerStrategy supports one LR scheduler",
        "two_groups": r"TwoGroups.configure_optimizers returned Adam with 2 parameter groups",
        "subset": r"over a subset of the trainable parameters \(missing net.2.weight, net.2.bias",
        "no_dummy": r"traces NoDummy.forward and needs an example input: add a property `dummy_forward_args`",
        "not_a_dict": r"NotADict.dummy_forward_args must be a dict of forward arguments by name, got list",
        "world": r"runtime_ngpus=4\)\) but the Trainer runs 2 process\(es\)",
        "outside_forward": r"UsesModuleOutsideForward.training_step failed with TypeError: .*self.net is None: the "
                           r"traced modules run only inside forward",
        "param_outside_forward": r"Temperature.temperature is a trainable parameter used outside forward with grad "
                                 r"enabled: .*use it under torch.no_grad\(\), or freeze it",
        "direct_param_outside_forward": r"Scaled.scale is a trainable parameter used outside forward with grad enabled",
    }
    import re
    for rank, result in enumerate(out):
        for case, pattern in expected.items():
            assert result[case] is not None, f"rank {rank}: {case} was not refused"
            is_nnscaler, cls, message = result[case]
            assert is_nnscaler, f"{case}: {cls}: {message}"
            assert re.search(pattern, message), f"{case}: {message}"
        assert result["from_batch_steps"] == 4  # dummy_forward_args_fn(first batch) traced and trained
        # under torch.no_grad() the untraced parameter is usable, and it is the guard
        assert result["no_grad"] == (4, 2.0, "OutsideForwardParameter")
        # a parameter of the module itself, read under no_grad after training: the trained value
        read, trained = result["scaled"]
        assert read == trained and read != 1.5


def test_direct_parameter_under_use_zero_3_is_refused_outside_forward():
    """A trainable parameter the LightningModule holds directly, traced whole, is read under
    torch.no_grad() outside forward with the other plans; under use_zero=3 the parallel module
    keeps only a shard of it (its storage is given up), so any use raises, naming use_zero=3."""
    from types import SimpleNamespace
    from nnscaler.lightning.param_guard import OutsideForwardParameter, guard_direct_parameters
    scale = torch.nn.Parameter(torch.ones(3))
    entry = SimpleNamespace(full_name="scale", full_shape=(3,), value_split=())
    for sharded in (None, object()):  # fully_sharded unset (dp, tp, ZeRO-1) and set (use_zero=3)
        module = torch.nn.Module()
        module.scale = None  # as convert() leaves it
        pm = SimpleNamespace(named_parameters=lambda: [("scale_1", scale)], fullmap={"scale_1": entry},
                             fully_sharded=sharded)
        assert guard_direct_parameters(module, {"scale": scale}, pm, "Model") == ["scale"]
        assert isinstance(module.scale, OutsideForwardParameter)
        if sharded is None:
            with torch.no_grad():
                assert float(module.scale.sum()) == 3.0
        else:
            with pytest.raises(NnScalerError, match=r"Model.scale is used outside forward, but "
                                                    r"ComputeConfig\(use_zero=3\) shards it over the data-parallel"):
                with torch.no_grad():
                    module.scale.sum()
