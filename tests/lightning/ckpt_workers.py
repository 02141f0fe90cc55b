"""The multi-process halves of the Lightning checkpoint tests (run by run_workers)."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from lit_models import Classifier, full_weights, global_losses, trainer


def _strategy(root, name, plan_ngpus, policy, config=None, **kwargs):
    from nnscaler.ir import ComputeConfig
    from nnscaler.lightning import NnScalerStrategy
    return NnScalerStrategy(compute_config=ComputeConfig(plan_ngpus, dist.get_world_size(), **(config or {})),
                            pas_policy=policy, gen_savedir=os.path.join(root, "gen"), instance_name=name, **kwargs)


def _optimizer_state(t):
    state = t.strategy.optimizers[0].state_dict()["state"]
    return {k: {n: v.clone() for n, v in s.items()} for k, s in state.items()}


def _run(root, label, plan, epochs, ckpt_path=None, save=None, callbacks=None, kind="sharded"):
    name, plan_ngpus, policy, *config = plan  # (name, plan_ngpus, policy[, ComputeConfig fields])
    model = Classifier(batch_size=8 * plan_ngpus)
    t = trainer(_strategy(root, name, plan_ngpus, policy, *config, state_dict_type=kind), os.path.join(root, label),
                max_epochs=epochs, callbacks=callbacks or [], enable_checkpointing=bool(callbacks))
    t.fit(model, ckpt_path=ckpt_path)
    if save:
        t.save_checkpoint(save)
    return dict(losses=global_losses(model.step_losses), weights=full_weights(model), step=t.global_step,
                epoch=t.current_epoch, optim=_optimizer_state(t), val_loss=t.callback_metrics["val_loss"].clone())


def resume(rank, world, root, plan, kind):
    """4 epochs straight; 2 epochs, save, then resume to 4 (same plan); and resume from the
    merged checkpoint under the other plan."""
    from nnscaler.lightning import NnScalerStrategy
    straight = _run(root, "straight", plan, 4)
    path = os.path.join(root, "half.ckpt")
    first = _run(root, "first", plan, 2, save=path, kind=kind)
    saved = sorted(os.listdir(path))
    second = _run(root, "second", plan, 4, ckpt_path=path, kind=kind)
    merged = os.path.join(root, "merged")
    if rank == 0:
        NnScalerStrategy.merge_checkpoint([os.path.join(path, f) for f in saved], merged)
    dist.barrier()
    other = ("dp2", 1, "dp") if plan[1] == 2 else ("tp2", 2, "tp")
    from_merged = _run(root, "merged-run", other, 4, ckpt_path=merged)
    return dict(straight=straight, first=first, second=second, saved=saved, from_merged=from_merged)


def model_checkpoint(rank, world, root):
    """ModelCheckpoint writes checkpoint directories every epoch and last.ckpt; resume from it."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    plan = ("dp2", 1, "dp")
    cb = ModelCheckpoint(dirpath=os.path.join(root, "ckpts"), save_last=True, save_top_k=-1, every_n_epochs=1)
    fitted = _run(root, "mc", plan, 2, callbacks=[cb])
    listing = sorted(os.listdir(os.path.join(root, "ckpts")))
    last = os.path.join(root, "ckpts", "last.ckpt")
    # validate alone (no optimizer) from the checkpoint, under the other plan
    t = trainer(_strategy(root, "mc-validate", 2, "tp"), os.path.join(root, "validate"))
    t.validate(Classifier(batch_size=16), ckpt_path=last, verbose=False)
    validated = t.callback_metrics["val_loss"].clone()
    resumed = _run(root, "mc-resume", plan, 3, ckpt_path=last)
    return dict(listing=listing, is_dir=os.path.isdir(last), resumed_step=resumed["step"],
                fitted_val=fitted["val_loss"], validated_val=validated)


def other_plan(rank, world, root, kind):
    """A checkpoint of tp2 (2 epochs) loaded directly by a dp2 Trainer (no merge): it resumes
    to 4 epochs as 4 straight under dp2."""
    straight = _run(root, "straight-dp2", ("dp2", 1, "dp"), 4)
    path = os.path.join(root, "tp2.ckpt")
    _run(root, "first-tp2", ("tp2", 2, "tp"), 2, save=path, kind=kind)
    resumed = _run(root, "resumed-dp2", ("dp2", 1, "dp"), 4, ckpt_path=path, kind=kind)
    return dict(straight=straight, resumed=resumed)
