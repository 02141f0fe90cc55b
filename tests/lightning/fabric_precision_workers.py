"""The multi-process halves of the Fabric fp16 tests: one hand-written loop with Fabric's
DDPStrategy and its fp16 plugin, and with nnscaler's Fabric strategy and NnScalerPrecision (grad
scaler); then the scaler's state through fabric.save / fabric.load."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader

from fabric_workers import Net
from lit_models import FEATURES, dataset

SCALER = dict(init_scale=2.0 ** 10, growth_interval=2)


def _loop(strategy, plugin, batch_size):
    import lightning.fabric as lf
    fabric = lf.Fabric(strategy=strategy, accelerator="cpu", devices=dist.get_world_size(), plugins=[plugin])
    fabric.launch()
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = fabric.setup(model, opt)
    loader = fabric.setup_dataloaders(DataLoader(dataset(), batch_size=batch_size, shuffle=False))
    losses = []
    for x, y in loader:
        out = model(x)
        loss = F.cross_entropy(out, y)
        fabric.backward(loss)
        fabric.clip_gradients(model, opt, max_norm=1.0)
        opt.step()
        opt.zero_grad()
        losses.append(fabric.all_reduce(loss.detach().float(), reduce_op="mean"))
    return fabric, model, opt, torch.stack(losses), str(out.dtype)


def parity(rank, world, root, precision):
    from lightning.fabric.plugins.precision import HalfPrecision, MixedPrecision
    from lightning.fabric.strategies import DDPStrategy
    from nnscaler.ir import ComputeConfig
    from nnscaler.lightning.fabric import NnScalerPrecision, NnScalerStrategy
    from lit_models import full_weights
    ddp_plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", **SCALER)) \
        if precision == "16-mixed" else HalfPrecision("16-true")
    _, model, _, losses, _ = _loop(DDPStrategy(), ddp_plugin, 8)
    out = {"ddp": (losses, {k: v.detach().float().clone() for k, v in model.module.state_dict().items()})}
    for name, plan, policy, zero in (("dp2", 1, "dp", False), ("tp2", 2, "tp", False), ("dp2-zero", 1, "dp", True)):
        strategy = NnScalerStrategy(compute_config=ComputeConfig(plan, world, use_zero=zero), pas_policy=policy,
                                    gen_savedir=os.path.join(root, "gen"), instance_name=f"{name}-{precision}",
                                    dummy_forward_args={"x": torch.randn(8 * plan, FEATURES)})
        plugin = NnScalerPrecision(precision, scaler=torch.amp.GradScaler("cpu", **SCALER))
        fabric, model, opt, losses, out_dtype = _loop(strategy, plugin, 8 * plan)

        class Holder(torch.nn.Module):  # full_weights looks for the parallel module here
            pass
        holder = Holder()
        holder.nnscaler_pmodule = model._forward_module
        weights = full_weights(holder)
        scaler = fabric.strategy.precision.scaler
        saved = scaler.state_dict()
        path = os.path.join(root, f"{name}-{precision}.ckpt")
        fabric.save(path, {"model": model, "optimizer": opt})
        scaler.update(new_scale=3.0)  # change it, then load it back
        changed = scaler.state_dict()
        fabric.load(path, {"model": model, "optimizer": opt})
        out[name] = (losses, {k: v.float() for k, v in weights.items()}, {str(v.dtype) for v in weights.values()},
                     out_dtype, saved, changed, scaler.state_dict())
    return out if rank == 0 else None
