"""The multi-process halves of the fp16 precision tests: Lightning's DDPStrategy with its own fp16
plugin against NnScalerStrategy with NnScalerPrecision (grad scaler), and the scaler's state
through a checkpoint."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from lit_models import Classifier, full_weights, global_losses, trainer
from nnscaler.runtime.optimizer_state import optimizer_state

SCALER = dict(init_scale=2.0 ** 10, growth_interval=2)  # the scale moves within a short run


def _ddp_plugin(precision):
    from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision
    if precision == "16-mixed":
        return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", **SCALER))
    return HalfPrecision("16-true")


def _nnscaler(root, name, plan_ngpus, policy, precision, **kwargs):
    from nnscaler.ir import ComputeConfig
    from nnscaler.lightning import NnScalerPrecision, NnScalerStrategy
    strategy = NnScalerStrategy(compute_config=ComputeConfig(plan_ngpus, dist.get_world_size()), pas_policy=policy,
                                gen_savedir=os.path.join(root, "gen"), instance_name=f"{name}-{precision}")
    plugin = NnScalerPrecision(precision, scaler=torch.amp.GradScaler("cpu", **SCALER))
    return trainer(strategy, os.path.join(root, name), plugins=[plugin], **kwargs)


def parity(rank, world, root, precision, fit_kwargs):
    """DDP (batch 8 per rank) and nnscaler dp2 / tp2 in `precision`: losses, weights, scaler."""
    from lightning.pytorch.strategies import DDPStrategy
    model = Classifier(batch_size=8, lr=0.1, optimizer="sgd")
    t = trainer(DDPStrategy(), os.path.join(root, "ddp"), plugins=[_ddp_plugin(precision)], **fit_kwargs)
    t.fit(model)
    out = {"ddp": (global_losses(model.step_losses).float(),
                   {k: v.detach().float().clone() for k, v in model.state_dict().items()})}
    for name, plan_ngpus, policy in (("dp2", 1, "dp"), ("tp2", 2, "tp")):
        model = Classifier(batch_size=8 * plan_ngpus, lr=0.1, optimizer="sgd")
        t = _nnscaler(root, name, plan_ngpus, policy, precision, **fit_kwargs)
        t.fit(model)
        weights = full_weights(model)
        out[name] = (global_losses(model.step_losses).float(), {k: v.float() for k, v in weights.items()},
                     {k: str(v.dtype) for k, v in weights.items()}, model.logits_dtype,
                     t.strategy.precision_plugin.scaler.state_dict())
    return out if rank == 0 else None


def scaler_resume(rank, world, root, precision):
    """Fit 2 epochs and save; resume the checkpoint in a new Trainer (nothing left to train):
    the scaler's state is the saved one. Then resume to 3 epochs against 3 straight."""
    path = os.path.join(root, "half.ckpt")
    t = _nnscaler(root, "first", 2, "tp", precision, max_epochs=2)
    t.fit(Classifier(batch_size=16, lr=0.1, optimizer="sgd"))
    t.save_checkpoint(path)
    saved = t.strategy.precision_plugin.scaler.state_dict()
    again = _nnscaler(root, "again", 2, "tp", precision, max_epochs=2)
    again.fit(Classifier(batch_size=16, lr=0.1, optimizer="sgd"), ckpt_path=path)
    restored = again.strategy.precision_plugin.scaler.state_dict()
    straight_model = Classifier(batch_size=16, lr=0.1, optimizer="sgd")
    straight = _nnscaler(root, "straight", 2, "tp", precision, max_epochs=3)
    straight.fit(straight_model)
    resumed_model = Classifier(batch_size=16, lr=0.1, optimizer="sgd")
    resumed = _nnscaler(root, "resumed", 2, "tp", precision, max_epochs=3)
    resumed.fit(resumed_model, ckpt_path=path)
    return dict(saved=saved, restored=restored, straight=straight.strategy.precision_plugin.scaler.state_dict(),
                resumed=resumed.strategy.precision_plugin.scaler.state_dict(),
                straight_losses=torch.stack(straight_model.step_losses).float(),
                resumed_losses=torch.stack(resumed_model.step_losses).float())


def overflow_on_one_rank(rank, world):
    """Rank 1's gradient overflows, rank 0's does not (as tensor-parallel shards can): with
    NnScalerGradScaler both ranks skip the step and halve the scale; with torch's own scaler
    rank 0 would step alone."""
    from nnscaler.lightning.grad_scaler import NnScalerGradScaler
    out = {}
    for name, cls in (("ours", NnScalerGradScaler), ("torch", torch.amp.GradScaler)):
        p = torch.nn.Parameter(torch.ones(2, dtype=torch.float16))
        opt = torch.optim.SGD([p], lr=1.0)
        scaler = cls("cpu", init_scale=4.0)
        scaler.scale((p.float() * 1.0).sum()).backward()
        if rank == 1:
            p.grad[0] = float("inf")
        try:
            scaler.step(opt)
            scaler.update()
            out[name] = (p.detach().float().tolist(), scaler.get_scale())
        except ValueError as exc:  # torch's refuses fp16 gradients
            out[name] = str(exc)
    return out


def _nnscaler_zero(root, name, precision, scaler=None, config=None, model_batch=8, **kwargs):
    from nnscaler.ir import ComputeConfig
    from nnscaler.lightning import NnScalerPrecision, NnScalerStrategy
    cfg = ComputeConfig(1, dist.get_world_size(), use_zero=True, **(config or {}))
    strategy = NnScalerStrategy(compute_config=cfg, pas_policy="dp", gen_savedir=os.path.join(root, "gen"),
                                instance_name=f"{name}-{precision}")
    plugin = NnScalerPrecision(precision, scaler=torch.amp.GradScaler("cpu", **(scaler or SCALER)))
    return trainer(strategy, os.path.join(root, name), plugins=[plugin], **kwargs)


def zero_parity(rank, world, root, precision, fit_kwargs, configs):
    """DDP with Lightning's fp16 plugin against nnscaler dp2 + ZeRO (each of `configs`) in
    `precision`: losses, weights, dtypes, the scaler's state, the shard layout."""
    from lightning.pytorch.strategies import DDPStrategy
    model = Classifier(batch_size=8, lr=0.1, optimizer="sgd")
    t = trainer(DDPStrategy(), os.path.join(root, "ddp"), plugins=[_ddp_plugin(precision)], **fit_kwargs)
    t.fit(model)
    out = {"ddp": (global_losses(model.step_losses).float(),
                   {k: v.detach().float().clone() for k, v in model.state_dict().items()})}
    for name, config in configs:
        model = Classifier(batch_size=8, lr=0.1, optimizer="sgd")
        t = _nnscaler_zero(root, name, precision, config=config, **fit_kwargs)
        t.fit(model)
        weights = full_weights(model)
        opt = t.strategy.optimizers[0]
        out[name] = dict(losses=global_losses(model.step_losses).float(),
                         weights={k: v.float() for k, v in weights.items()},
                         dtypes={k: str(v.dtype) for k, v in weights.items()},
                         scaler=t.strategy.precision_plugin.scaler.state_dict(),
                         zero=opt.zero_layout is not None, syncs=optimizer_state(opt).zero.stats.syncs)
    return out if rank == 0 else None


class InfOnRankOne(Classifier):
    """Puts an inf into the gradient of the last parameter (which lies in rank 1's ZeRO shard) on
    rank 1 only, at batch `at` of the first epoch; records the scale and a checksum of the
    weights after each batch."""

    def __init__(self, at, **kwargs):
        super().__init__(**kwargs)
        self.at, self.record = at, []

    def on_after_backward(self):
        from nnscaler.lightning.model_setup import pmodule_of
        if dist.get_rank() == 1 and self.current_epoch == 0 and self._batch == self.at:
            last = list(pmodule_of(self).parameters())[-1]
            last.grad.view(-1)[0] = float("inf")

    def on_train_batch_start(self, batch, batch_idx):
        self._batch = batch_idx

    def on_train_batch_end(self, outputs, batch, batch_idx):
        from nnscaler.lightning.model_setup import pmodule_of
        params = list(pmodule_of(self).parameters())
        self.record.append((self.trainer.strategy.precision_plugin.scaler.get_scale(),
                            [p.detach().double().sum().item() for p in params]))


def zero_overflow(rank, world, root):
    """16-mixed with dp2 + ZeRO: (a) a loss scale of 2**40 overflows the fp16 gradients of every
    step: no step is taken on any rank (weights as initialized, no optimizer state) and the scale
    halves each step; (b) an inf in rank 1's shard only, at one batch: both ranks skip that step
    together."""
    from nnscaler.lightning.model_setup import pmodule_of
    init = Classifier(batch_size=8, lr=0.1, optimizer="sgd")
    initial = {k: v.detach().clone() for k, v in init.state_dict().items()}
    model = Classifier(batch_size=8, lr=0.1, optimizer="sgd")
    t = _nnscaler_zero(root, "huge", "16-mixed", scaler=dict(init_scale=2.0 ** 40, growth_interval=2), max_steps=3)
    t.fit(model)
    opt = t.strategy.optimizers[0]
    huge = dict(weights=full_weights(model), initial=initial, scale=t.strategy.precision_plugin.scaler.get_scale(),
                state=len(opt.state), batches=len(model.step_losses),
                shard_numel=sum(p.numel() for g in opt.param_groups for p in g["params"]),
                module_numel=sum(p.numel() for p in pmodule_of(model).parameters()))
    model = InfOnRankOne(at=2, batch_size=8, lr=0.1, optimizer="sgd")
    t = _nnscaler_zero(root, "one-rank", "16-mixed", max_epochs=1)
    t.fit(model)
    return dict(huge=huge, one_rank=model.record)
