"""nnscaler's Fabric strategy against Fabric's own DDPStrategy on the same hand-written loop
(gradient accumulation with no_backward_sync, clip_gradients, SGD with momentum) at dp2, tp2 and
dp2 with use_zero=3 (fully sharded), and at tp2 and dp2 fully sharded with the model built on the
meta device (``fabric.init_module(empty_init=True)``: each rank allocates only its part, with the
values of the CPU build), on 2 real gloo processes: per-step losses and final weights within 1e-5;
fabric.save / load round trip through nnscaler.ckpt; ``fabric.load_raw`` into a meta-built model
from another plan's checkpoint and from a Hugging Face-style directory (exact). Refusals of
load_raw / load misuse, fast."""
from __future__ import annotations

import pytest
import torch

TOL = 1e-5


@pytest.mark.multiprocess
def test_fabric_matches_ddp_and_round_trips(tmp_path):
    from launch import run_workers
    import fabric_workers
    out = run_workers(fabric_workers.parity, 2, str(tmp_path), timeout=300)[0]
    ref_losses, ref_weights = out["ddp"]
    assert len(ref_losses) == 8  # 2 epochs of 32 samples per rank, batch 8
    cpu_built = fabric_workers.Net().state_dict()
    full = sum(v.numel() for v in cpu_built.values())
    for name in ("dp2", "tp2", "dp2-zero3", "tp2-meta", "dp2-zero3-meta"):
        losses, weights, reloaded, step, pair, left, same_optim, initial = out[name]
        if name.endswith("-meta"):  # only this rank's part was allocated, with the CPU build's values
            assert initial["held"] < full, (name, initial["held"], full)
            for source, want in (("weights", cpu_built), ("dp2", out["dp2"][1]), ("hf", cpu_built)):
                assert set(initial[source]) == set(want), (name, source)
                assert all(torch.equal(initial[source][k], v) for k, v in want.items()), (name, source)
        torch.testing.assert_close(losses, ref_losses, atol=TOL, rtol=0, msg=lambda m: f"{name}: {m}")
        assert set(weights) == set(ref_weights)
        for k, v in ref_weights.items():
            torch.testing.assert_close(weights[k], v, atol=TOL, rtol=0, msg=lambda m: f"{name} {k}: {m}")
        for k, v in weights.items():  # load put back what save wrote (the weights were zeroed)
            assert torch.equal(reloaded[k], v), f"{name} {k}"
        assert step == 7 and pair == (1, 2) and left == {} and same_optim


def test_fabric_registry_and_refusals(tmp_path):
    import lightning.fabric as lf
    from nnscaler.ir import NnScalerError
    from nnscaler.lightning.fabric import NnScalerStrategy
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    assert STRATEGY_REGISTRY["nnscaler"]["strategy"] is NnScalerStrategy
    with pytest.raises(NnScalerError, match=r"state_dict_type='x'"):
        NnScalerStrategy(state_dict_type="x")
    s = NnScalerStrategy()
    with pytest.raises(NnScalerError, match=r"fabric.setup\(model, \*optimizers\) got 2 optimizers"):
        m = torch.nn.Linear(2, 2)
        s.setup_module_and_optimizers(m, [torch.optim.SGD(m.parameters(), lr=1), torch.optim.SGD(m.parameters(), lr=1)])
    with pytest.raises(NnScalerError, match=r"fabric.setup got SGD with 2 parameter groups"):
        m = torch.nn.Linear(2, 2)
        s.setup_module_and_optimizers(m, [torch.optim.SGD([{"params": [m.weight]}, {"params": [m.bias]}], lr=1)])
    # load_raw takes a model only, strictly; a Hugging Face directory goes through load_raw, not load
    from safetensors.torch import save_file
    with pytest.raises(NnScalerError, match=r"fabric.load_raw\(path, SGD\) with NnScalerStrategy: an optimizer's "
                                            r"state is loaded with its model, by fabric.load"):
        s.load_checkpoint(tmp_path, torch.optim.SGD(m.parameters(), lr=1))
    with pytest.raises(NnScalerError, match=r"strict=False\) with NnScalerStrategy: the checkpoint must hold every "
                                            r"tensor of the model; leave strict=True"):
        s.load_checkpoint(tmp_path, m, strict=False)
    (tmp_path / "hf").mkdir()
    save_file({"weight": torch.zeros(2, 2)}, str(tmp_path / "hf" / "model.safetensors"))
    with pytest.raises(NnScalerError, match=r"a Hugging Face model directory holds only the model's weights: call "
                                            r"fabric.load_raw\(path, model\)"):
        s.load_checkpoint(tmp_path / "hf", {"model": m})
