"""A classifier of a few Linear layers on generated data, as a LightningModule, and helpers the
Lightning workers share (Trainer construction, full weights of a parallel module)."""
from __future__ import annotations

from typing import Dict

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

FEATURES, HIDDEN, CLASSES, SAMPLES = 16, 32, 4, 64


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    y = torch.randint(0, CLASSES, (SAMPLES,), generator=g)
    return TensorDataset(x, y)


class Base(pl.LightningModule):
    """The classifier without a tracing input (see Classifier)."""

    def __init__(self, batch_size: int = 8, lr: float = 1e-2, optimizer: str = "adam"):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.ReLU(),
                                       torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(),
                                       torch.nn.Linear(HIDDEN, CLASSES))
        self.batch_size, self.lr, self.opt_name = batch_size, lr, optimizer
        self.step_losses = []

    def forward(self, x):
        return self.net(x)  # logits, not a loss

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.logits_dtype = str(logits.dtype)
        loss = F.cross_entropy(logits, y)
        self.step_losses.append(loss.detach().clone())
        self.log("train_loss", loss, sync_dist=True)
        self.log("loss_sum", loss, sync_dist=True, reduce_fx="sum", on_step=True, on_epoch=False)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y), sync_dist=True)

    def val_dataloader(self):
        return DataLoader(dataset(), batch_size=self.batch_size, shuffle=False)

    def configure_optimizers(self):
        if self.opt_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        return torch.optim.Adam(self.parameters(), lr=self.lr)

    def train_dataloader(self):
        return DataLoader(dataset(), batch_size=self.batch_size, shuffle=False)


class Classifier(Base):
    @property
    def dummy_forward_args(self):
        return {"x": torch.randn(self.batch_size, FEATURES)}


def trainer(strategy, root, **kwargs) -> pl.Trainer:
    args = dict(accelerator="cpu", devices=dist.get_world_size(), max_epochs=2, logger=False,
                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                default_root_dir=str(root), num_sanity_val_steps=0)
    args.update(kwargs)
    return pl.Trainer(strategy=strategy, **args)


def full_weights(module: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """The full (single-device) state of the parallel module inside `module`, on every rank,
    assembled from each rank's pieces (public `fullmap`); value-split parts are summed. Fully
    sharded parameters (use_zero=3) are read inside `pm.unsharded()` (collective)."""
    from nnscaler.lightning.model_setup import pmodule_of
    pm = pmodule_of(module)
    with pm.unsharded():
        local = dict(pm.named_parameters())
        local.update(dict(pm.named_buffers()))
        pieces = [(e.full_name, tuple(e.full_shape), tuple(e.slices), tuple(e.value_split),
                   local[name].detach().clone()) for name, e in pm.fullmap.items() if name in local]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, pieces)
    full: Dict[str, torch.Tensor] = {}
    done = set()
    for rank_pieces in gathered:
        for name, shape, slices, (part, _), value in rank_pieces:
            key = (name, slices, part)
            if key in done:
                continue
            done.add(key)
            t = full.setdefault(name, torch.zeros(shape, dtype=value.dtype))
            t[tuple(slice(a, b) for a, b in slices)] += value
    return full


def global_losses(losses) -> torch.Tensor:
    """The per-step loss averaged over every rank (DDP ranks hold the losses of their shards; the
    ranks of an nnscaler unit hold the same loss)."""
    t = torch.stack(losses)
    dist.all_reduce(t)
    return t / dist.get_world_size()
