"""The multi-process halves of the FSDP-style argument tests: activation checkpointing (parity
and recomputation observed), `configure_model` (also on the meta device) and `cpu_offload`."""
from __future__ import annotations

import glob
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lit_models import Base, Classifier, FEATURES, HIDDEN, CLASSES, full_weights, global_losses, trainer


class CountsSaved(Classifier):
    """Counts the tensors autograd saves during forward (saved-tensor hooks): recomputed
    segments save only their inputs."""

    def training_step(self, batch, batch_idx):
        count = [0]

        def pack(t):
            count[0] += 1
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = self(batch[0])
        self.saved_counts = getattr(self, "saved_counts", []) + [count[0]]
        loss = F.cross_entropy(out, batch[1])
        self.step_losses.append(loss.detach().clone())
        return loss


class BuiltInHook(Base):
    """The network is built in configure_model (on the meta device when `meta`)."""

    def __init__(self, meta: bool, batch_size: int = 8):
        super().__init__(batch_size=batch_size)
        self.net, self.meta = None, meta

    @property
    def dummy_forward_args(self):
        return {"x": torch.randn(self.batch_size, FEATURES)}

    def configure_model(self):
        if self.net is not None:
            return
        torch.manual_seed(0)
        with torch.device("meta") if self.meta else torch.device("cpu"):
            self.net = torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.ReLU(),
                                           torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(),
                                           torch.nn.Linear(HIDDEN, CLASSES))
        self.built_on = str(next(self.net.parameters()).device)


def _strategy(root, name, plan_ngpus=1, policy="dp", **kwargs):
    from nnscaler.ir import ComputeConfig
    from nnscaler.lightning import NnScalerStrategy
    return NnScalerStrategy(compute_config=ComputeConfig(plan_ngpus, dist.get_world_size()), pas_policy=policy,
                            gen_savedir=os.path.join(root, "gen"), instance_name=name, **kwargs)


def _fit(model, strategy, root, name):
    t = trainer(strategy, os.path.join(root, name))
    t.fit(model)
    return t


def checkpointing(rank, world, root):
    """The same training with and without activation_checkpointing_policy={Linear}, dp2 and tp2."""
    out = {}
    for name, plan, policy in (("dp2", 1, "dp"), ("tp2", 2, "tp")):
        for recompute in (False, True):
            label = f"{name}-{'ckpt' if recompute else 'plain'}"
            model = CountsSaved(batch_size=8 * plan)
            types = {torch.nn.Linear} if recompute else None
            _fit(model, _strategy(root, label, plan, policy, activation_checkpointing_policy=types), root, label)
            files = glob.glob(os.path.join(root, "gen", "**", label, "**", "gencode*.py"), recursive=True)
            codes = [open(f).read() for f in files]
            out[label] = dict(losses=global_losses(model.step_losses), weights=full_weights(model),
                              saved=model.saved_counts[0], code_files=len(codes),
                              checkpoint_calls={c.count("torch.utils.checkpoint.checkpoint(") for c in codes})
    return out if rank == 0 else None


def configure_model(rank, world, root):
    """DDP with the network built in configure_model, against nnscaler with it built there on
    the CPU and on the meta device; and with cpu_offload=True."""
    from lightning.pytorch.strategies import DDPStrategy
    out = {}
    model = BuiltInHook(meta=False)
    trainer(DDPStrategy(), os.path.join(root, "ddp")).fit(model)
    out["ddp"] = (global_losses(model.step_losses), {k: v.detach().clone() for k, v in model.state_dict().items()})
    for label, meta, offload in (("cpu", False, False), ("meta", True, False), ("offload", False, True)):
        model = BuiltInHook(meta=meta)
        t = _fit(model, _strategy(root, label, cpu_offload=offload), root, label)
        state = t.strategy.optimizers[0].state
        devices = {v.device.type for s in state.values() for v in s.values() if isinstance(v, torch.Tensor)}
        out[label] = (global_losses(model.step_losses), full_weights(model), model.built_on, model.net, devices)
    return out if rank == 0 else None
