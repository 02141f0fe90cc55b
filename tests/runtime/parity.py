"""The training loop the parity tests run on every rank (importable by spawned workers)."""
from __future__ import annotations

import torch
import torch.distributed as dist


def train_steps(pm, opt, batch_fn, *, steps, global_batch, dp_rank, dp, end2end=False, clip=None):
    """`steps` Adam steps, each data-parallel replica on its slice of the global batch; returns
    the loss of every step averaged over all ranks."""
    per = global_batch // dp
    losses = []
    for step in range(steps):
        full = batch_fn(step, global_batch)
        mine = {k: v[dp_rank * per:(dp_rank + 1) * per] for k, v in full.items()}
        opt.zero_grad()
        if end2end:
            loss = pm.train_step([mine])[0]
        else:
            loss = pm(**mine)
            loss.backward()
        if clip is not None:
            opt.clip_gnorm(clip)
        opt.step()
        t = loss.detach().reshape(1).clone()
        dist.all_reduce(t)
        losses.append(t.item() / dist.get_world_size())
    return losses


def one_process_adam(model, batch_fn, *, steps, lr):
    """The one-process reference: `steps` Adam steps of `model` on `batch_fn(step)` (its trainable
    parameters); returns (losses, every parameter's value after the last step)."""
    import torch
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        loss = model(**batch_fn(step))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def assemble_full(shards, label):
    """Full tensors from `shards`: an iterable of (rank, [(full name, full shape, slices, value), ...]).
    Every element must be held by some rank (checked by the caller through NaNs) and ranks holding
    the same slice must agree exactly."""
    full = {}
    for rank, pieces in shards:
        for name, shape, slices, value in pieces:
            tensor = full.setdefault(name, torch.full(shape, float("nan"), dtype=value.dtype))  # float64 stays exact
            index = tuple(slice(a, b) for a, b in slices)
            if not torch.isnan(tensor[index]).all():
                assert torch.equal(tensor[index], value), f"{label}: rank {rank} disagrees with another on {name}{slices}"
            tensor[index] = value
    return full
