"""Small end2end models and datasets the trainer tests name in their configs
(``trainer_models.MLP`` etc.; this folder is on sys.path / PYTHONPATH)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from nnscaler.runtime import aggregate_outputs, count_tokens


class MLP(nn.Module):
    """forward(batch) -> loss; ``batch = {'x': [b, dim], 'y': [b, dim]}``."""

    def __init__(self, dim: int = 16, nlayers: int = 2, dropout: float = 0.0, name: str = ""):
        super().__init__()  # name: a str argument, for the command line's typing tests
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(nlayers))
        self.dropout = dropout

    def forward(self, batch):
        x = batch["x"]
        for layer in self.layers:
            x = torch.relu(layer(x))
            if self.dropout:
                x = F.dropout(x, self.dropout, self.training)
        return F.mse_loss(x, batch["y"])


class SumLossMLP(MLP):
    """Returns (sum of squared errors over tokens, number of tokens) for per-token-mean."""

    def forward(self, batch):
        x = batch["x"]
        for layer in self.layers:
            x = torch.relu(layer(x))
        return ((x - batch["y"]) ** 2).sum(), batch["mask"].sum()


class RandomDataset(torch.utils.data.Dataset):
    """Deterministic samples: item i depends only on (seed, i)."""

    def __init__(self, size: int = 64, dim: int = 16, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, dim, generator=g)
        self.y = torch.randn(size, dim, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i], "mask": torch.ones(self.x.shape[1])}


def count_token_outputs(loss_outputs, sync_group):
    """aggregate_outputs_fn for SumLossMLP: loss sum and token count over replicas."""
    agg = aggregate_outputs(loss_outputs, sync_group)
    agg.num_tokens = count_tokens(int(sum(float(o[1]) for o in loss_outputs)), sync_group)
    return agg


def mlp_forward_args(trainer_args):
    """forward_args_gen_fn of Inner (parallel_modules test)."""
    return {"x": torch.randn(trainer_args.micro_batch_size, 16)}


class Inner(nn.Module):
    def __init__(self, dim: int = 16):
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        return torch.relu(self.fc(x))


class Outer(nn.Module):
    """A plain model whose Inner sub-modules are parallelized (model.parallel_modules)."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.a = Inner(dim)
        self.head = nn.Linear(dim, dim)

    def forward(self, batch):
        return F.mse_loss(self.head(self.a(batch["x"])), batch["y"])


class RecordingHook:
    """A hook (HookConfig type) that records every call; read `RecordingHook.calls` after a run."""

    calls: list = []
    losses: list = []

    def __init__(self):
        RecordingHook.calls = []
        RecordingHook.losses = []

    def before_sync_grad(self, trainer):  # defined on the class: the Trainer defers the sync for it
        RecordingHook.calls.append("before_sync_grad")

    def __getattr__(self, name):
        from nnscaler.trainer.hooks import HOOK_NAMES
        if name not in HOOK_NAMES:
            raise AttributeError(name)

        def record(trainer, *args):
            RecordingHook.calls.append(name)
            if name == "on_step_end":
                RecordingHook.losses.append(args[2].train_loss)
            if name == "on_save_checkpoint":
                args[0]["user"] = {"saved_at": trainer.state.step}
            if name == "on_load_checkpoint":
                RecordingHook.calls.append(("loaded", args[0].get("user")))
        return record


def full_weights(model):
    """This rank's parameters as (full name, full shape, slices, value) pieces (tests/runtime/parity.assemble_full);
    fully sharded parameters (use_zero: 3) are read inside `pm.unsharded()` (collective)."""
    from nnscaler.runtime import ParallelModule
    pieces = []
    for pm_path, pm in model.named_modules():
        if not isinstance(pm, ParallelModule):
            continue
        with pm.unsharded():
            for name, p in pm.named_parameters():
                e = pm.fullmap[name]
                prefix = f"{pm_path}." if pm_path else ""
                pieces.append((prefix + e.full_name, e.full_shape, e.slices, p.detach().clone()))
    return pieces


class FailingDataset(RandomDataset):
    """Raises when rank 1 reads its 9th sample (a data error in the middle of a run)."""

    def __getitem__(self, i):
        import os
        self.reads = getattr(self, "reads", 0) + 1
        if os.environ.get("RANK") == "1" and self.reads == 9:
            raise RuntimeError("bad sample on rank 1")
        return super().__getitem__(i)


class NeedsArgs(MLP):
    """A model with a required, an Optional and **kwargs arguments (the model.args checks)."""

    def __init__(self, width: int, scale: Optional[float] = 1.0, **kwargs):
        super().__init__(dim=width)


class TrainOnlyNoiseMLP(MLP):
    """`MLP` whose forward adds noise in training mode only, by a Python branch on self.training
    (as transformers' router_jitter_noise does): its generated code cannot run in eval mode."""

    def forward(self, batch):
        x = batch["x"]
        if self.training:
            x = x * (1 + 0.01 * torch.rand_like(x))
        return super().forward({"x": x, "y": batch["y"]})
