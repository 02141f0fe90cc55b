"""The multi-process halves of the Lightning tests (run by run_workers on gloo processes).

Each worker trains with Lightning's own DDPStrategy and then with NnScalerStrategy on the same
model, data and settings, and returns per-step global losses and final full weights of each."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy

from lit_models import Classifier, full_weights, global_losses, trainer


def _ddp(root, batch_size, **fit_kwargs):
    model = Classifier(batch_size=batch_size)
    t = trainer(DDPStrategy(), os.path.join(root, "ddp"), **fit_kwargs)
    t.fit(model)
    return global_losses(model.step_losses), {k: v.detach().clone() for k, v in model.state_dict().items()}, \
        t.callback_metrics["loss_sum"].clone(), t.callback_metrics["val_loss"].clone()


def _nnscaler(root, name, plan_ngpus, policy, batch_size, config=None, strategy_kwargs=None, **fit_kwargs):
    from nnscaler.ir import ComputeConfig
    from nnscaler.lightning import NnScalerStrategy
    world = dist.get_world_size()
    model = Classifier(batch_size=batch_size)
    strategy = NnScalerStrategy(compute_config=ComputeConfig(plan_ngpus, world, **(config or {})), pas_policy=policy,
                                gen_savedir=os.path.join(root, "gen"), instance_name=name, **(strategy_kwargs or {}))
    t = trainer(strategy, os.path.join(root, name), **fit_kwargs)
    t.fit(model)
    if (strategy_kwargs or {}).get("sharding_strategy") == "FULL_SHARD":  # FSDP's name selected use_zero=3
        assert strategy.compute_config.zero_stage == 3 and model.nnscaler_pmodule.fully_sharded is not None
    removed = model.net is None
    return global_losses(model.step_losses), full_weights(model), removed, t.callback_metrics["loss_sum"].clone(), \
        t.callback_metrics["val_loss"].clone(), model.logits_dtype


def parity(rank, world, root, plans, fit_kwargs):
    """DDP (batch 8 per rank) against each (name, plan_ngpus, policy): a plan of plan_ngpus
    devices runs one unit per plan_ngpus ranks, so its batch is 8 * plan_ngpus."""
    out = {"ddp": _ddp(root, 8, **fit_kwargs)}
    for name, plan_ngpus, policy, *config in plans:  # config: [ComputeConfig fields[, strategy arguments]]
        out[name] = _nnscaler(root, name, plan_ngpus, policy, 8 * plan_ngpus, *config, **fit_kwargs)
    return out if rank == 0 else None


def registered(rank, world, root):
    """Trainer(strategy="nnscaler", devices=world): data parallel over every device."""
    import nnscaler.lightning  # noqa: F401 - registers "nnscaler"
    from nnscaler.lightning import NnScalerStrategy
    os.chdir(root)  # the default gen_savedir is ./.nnscaler
    model = Classifier(batch_size=8)
    t = trainer("nnscaler", root, max_epochs=1)
    assert isinstance(t.strategy, NnScalerStrategy)
    sampler_kwargs = t.strategy.distributed_sampler_kwargs
    t.fit(model)
    cfg = t.strategy.compute_config
    return dict(plan=(cfg.plan_ngpus, cfg.runtime_ngpus), sampler=sampler_kwargs, steps=t.global_step,
                losses=len(model.step_losses), generated=os.path.isdir(os.path.join(root, ".nnscaler")))
