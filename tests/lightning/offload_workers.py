"""The multi-process halves of the cpu_offload tests: NnScalerStrategy(cpu_offload=True) (the
optimizer steps on fp32 copies on the CPU, offload.py) against Lightning's DDP with an LR
scheduler, gradient accumulation and clipping; what the optimizer holds; save / resume; Fabric."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from lit_models import Classifier, full_weights, global_losses, trainer


class Scheduled(Classifier):
    """Adam with a StepLR halving the learning rate every epoch."""

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=self.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)}


def _strategy(root, name, plan_ngpus, policy, config=None, **kwargs):
    from nnscaler.ir import ComputeConfig
    from nnscaler.lightning import NnScalerStrategy
    return NnScalerStrategy(compute_config=ComputeConfig(plan_ngpus, dist.get_world_size(), **(config or {})),
                            pas_policy=policy, gen_savedir=os.path.join(root, "gen"), instance_name=name, **kwargs)


def _storages(tensors):
    return {t.untyped_storage().data_ptr() for t in tensors if t.numel()}


def held(t) -> dict:
    """What the trained optimizer holds, as observable facts."""
    from nnscaler.lightning.model_setup import pmodule_of
    from nnscaler.lightning.offload import OffloadedOptimizer
    opt = t.strategy.optimizers[0]
    pm = pmodule_of(t.lightning_module)
    module_params = list(pm.parameters())
    states = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    group = opt.param_groups[0]["params"]
    return dict(offloaded=isinstance(opt, OffloadedOptimizer),
                device=str(getattr(opt, "offload_device", None)),
                state_devices={v.device.type for v in states}, state_dtypes={str(v.dtype) for v in states},
                n_states=len(states),
                # the state tensors and the stepped tensors share no memory with the module's parameters
                state_shares_module_memory=bool(_storages(states) & _storages(module_params)),
                group_shares_module_memory=bool(_storages(group) & _storages(module_params)),
                group_is_module_params=any(p is q for p in group for q in module_params),
                state_numel=sum(v.numel() for s in opt.state.values() for v in s.values()
                                if isinstance(v, torch.Tensor) and v.dim() > 0),
                module_numel=sum(p.numel() for p in module_params),
                zero=opt.zero_layout is not None, lr=opt.param_groups[0]["lr"],
                stepped_state_keys=sorted(opt.state_dict()["state"].keys()))


def parity(rank, world, root, fit_kwargs):
    """DDP (batch 8 per rank) against cpu_offload=True at dp2, tp2 and dp2 + ZeRO."""
    from lightning.pytorch.strategies import DDPStrategy
    model = Scheduled(batch_size=8)
    t = trainer(DDPStrategy(), os.path.join(root, "ddp"), **fit_kwargs)
    t.fit(model)
    out = {"ddp": dict(losses=global_losses(model.step_losses),
                       weights={k: v.detach().clone() for k, v in model.state_dict().items()},
                       lr=t.optimizers[0].param_groups[0]["lr"])}
    for name, plan, policy, config in (("dp2", 1, "dp", None), ("tp2", 2, "tp", None),
                                       ("dp2-zero", 1, "dp", {"use_zero": True})):
        model = Scheduled(batch_size=8 * plan)
        t = trainer(_strategy(root, name, plan, policy, config, cpu_offload=True), os.path.join(root, name),
                    **fit_kwargs)
        t.fit(model)
        out[name] = dict(losses=global_losses(model.step_losses), weights=full_weights(model), **held(t))
    return out if rank == 0 else None


def _optimizer_state(t):
    state = t.strategy.optimizers[0].state_dict()["state"]
    return {k: {n: v.clone() for n, v in s.items()} for k, s in state.items()}


def _run(root, label, epochs, offload, ckpt_path=None, save=None):
    model = Classifier(batch_size=8)
    t = trainer(_strategy(root, label, 1, "dp", {"use_zero": True}, cpu_offload=offload), os.path.join(root, label),
                max_epochs=epochs)
    t.fit(model, ckpt_path=ckpt_path)
    if save:
        t.save_checkpoint(save)
    return dict(losses=global_losses(model.step_losses), weights=full_weights(model), step=t.global_step,
                optim=_optimizer_state(t), held=held(t))


def resume(rank, world, root):
    """dp2 + ZeRO with cpu_offload: 4 epochs straight; 2, save, resume to 4; and resume the
    same checkpoint without offload."""
    path = os.path.join(root, "offload.ckpt")
    straight = _run(root, "straight", 4, True)
    first = _run(root, "first", 2, True, save=path)
    second = _run(root, "second", 4, True, ckpt_path=path)
    plain = _run(root, "plain", 4, False, ckpt_path=path)
    return dict(straight=straight, first=first, second=second, plain=plain, saved=sorted(os.listdir(path)))


def fabric_parity(rank, world, root):
    """Fabric's loop (fabric_workers) with Fabric's DDP and with nnscaler's dp2 + cpu_offload."""
    from lightning.fabric.strategies import DDPStrategy
    from nnscaler.ir import ComputeConfig
    from nnscaler.lightning.fabric import NnScalerStrategy
    from nnscaler.lightning.offload import OffloadedOptimizer
    from fabric_workers import _loop
    from lit_models import FEATURES
    losses = []
    _, model, _ = _loop(DDPStrategy(), 8, losses)
    out = {"ddp": (torch.stack(losses), {k: v.detach().clone() for k, v in model.module.state_dict().items()})}
    losses = []
    strategy = NnScalerStrategy(compute_config=ComputeConfig(1, world), pas_policy="dp",
                                gen_savedir=os.path.join(root, "gen"), instance_name="fabric-offload",
                                dummy_forward_args={"x": torch.randn(8, FEATURES)}, cpu_offload=True)
    _, model, opt = _loop(strategy, 8, losses)
    pm = model._forward_module
    weights = {pm.fullmap[k].full_name: v.detach().clone() for k, v in pm.named_parameters()}
    inner = opt.optimizer
    states = [v for s in inner.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    out["offload"] = (torch.stack(losses), weights, isinstance(inner, OffloadedOptimizer), len(states),
                      bool(_storages(states) & _storages(list(pm.parameters()))))
    return out if rank == 0 else None
