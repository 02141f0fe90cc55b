"""The multi-process halves of the Fabric tests: the same hand-written loop with Fabric's
DDPStrategy and with nnscaler's Fabric strategy (dp2, tp2, dp2 fully sharded, and tp2 and dp2
fully sharded with the model built on the meta device by ``fabric.init_module(empty_init=True)``),
then a save / load round trip; the meta-built models also take weights by ``fabric.load_raw`` from
the dp2 checkpoint and from a Hugging Face-style directory."""
from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader

from lit_models import CLASSES, FEATURES, HIDDEN, dataset


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.ReLU(),
                                       torch.nn.Linear(HIDDEN, CLASSES))

    def forward(self, x):
        return self.net(x)


def _loop(strategy, batch_size, steps_out, meta=False, after_setup=None):
    import lightning.fabric as lf
    fabric = lf.Fabric(strategy=strategy, accelerator="cpu", devices=dist.get_world_size())
    fabric.launch()
    with fabric.init_module(empty_init=True) if meta else contextlib.nullcontext():
        model = Net()
    assert all(p.is_meta for p in model.parameters()) == meta
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = fabric.setup(model, opt)
    if after_setup is not None:
        after_setup(model)
    loader = fabric.setup_dataloaders(DataLoader(dataset(), batch_size=batch_size, shuffle=False))
    for epoch in range(2):
        for i, (x, y) in enumerate(loader):
            accumulating = i % 2 == 0
            with fabric.no_backward_sync(model, enabled=accumulating):
                loss = F.cross_entropy(model(x), y) / 2
                fabric.backward(loss)
            steps_out.append(fabric.all_reduce(loss.detach().clone(), reduce_op="mean"))
            if not accumulating:
                fabric.clip_gradients(model, opt, max_norm=0.5)
                opt.step()
                opt.zero_grad()
    return fabric, model, opt


PLANS = (("dp2", 1, "dp", {}), ("tp2", 2, "tp", {}),
         ("dp2-zero3", 1, "dp", {"use_zero": 3}),  # fully sharded: parameters, gradients, optimizer state
         ("tp2-meta", 2, "tp", {}), ("dp2-zero3-meta", 1, "dp", {"use_zero": 3}))  # built on meta


class Holder(torch.nn.Module):  # full_weights looks for the parallel module here
    def __init__(self, model):
        super().__init__()
        self.nnscaler_pmodule = getattr(model, "_forward_module", model)


def _held(model):
    """The elements this rank allocated for the model's parameters (under use_zero=3: its shards)."""
    pm = model._forward_module
    fs = pm.fully_sharded
    return sum(p.numel() for p in pm.parameters()) + (sum(u.shard.numel() for u in fs.units) if fs else 0)


def parity(rank, world, root):
    from lightning.fabric.strategies import DDPStrategy
    from nnscaler.ir import ComputeConfig
    from nnscaler.lightning.fabric import NnScalerStrategy
    from lit_models import full_weights
    out = {}
    losses = []
    _, model, _ = _loop(DDPStrategy(), 8, losses)
    out["ddp"] = (torch.stack(losses), {k: v.detach().clone() for k, v in model.module.state_dict().items()})
    if rank == 0:  # a Hugging Face-style directory of the CPU-built weights (load_raw's other source)
        from safetensors.torch import save_file
        os.makedirs(os.path.join(root, "hf"))
        with torch.random.fork_rng(devices=[]):  # Net() seeds: the ranks' generators stay alike
            weights = Net().state_dict()
        save_file({k: v.contiguous() for k, v in weights.items()},
                  os.path.join(root, "hf", "model.safetensors"))
    dist.barrier()
    for name, plan, policy, config in PLANS:
        losses, meta, initial = [], name.endswith("-meta"), {}
        strategy = NnScalerStrategy(compute_config=ComputeConfig(plan, world, **config), pas_policy=policy,
                                    gen_savedir=os.path.join(root, "gen"), instance_name=name,
                                    dummy_forward_args={"x": torch.randn(8 * plan, FEATURES)})
        hook = (lambda m: initial.update(held=_held(m), weights=full_weights(Holder(m)))) if meta else None
        fabric, model, opt = _loop(strategy, 8 * plan, losses, meta, hook)
        holder = Holder(model)
        weights = full_weights(holder)
        path = os.path.join(root, f"{name}.ckpt")
        fabric.save(path, {"model": model, "optimizer": opt, "step": 7, "pair": (1, 2)})
        before = {k: v.clone() for k, v in opt.optimizer.state_dict()["state"][0].items()}
        pm = model._forward_module
        with pm.unsharded(writeback=True), torch.no_grad():  # use_zero=3: the shards are zeroed too
            for p in pm.parameters():
                p.zero_()
        state = {"model": model, "optimizer": opt, "step": 0, "pair": None}
        left = fabric.load(path, state)
        after = opt.optimizer.state_dict()["state"][0]
        reloaded = full_weights(holder)
        if meta:  # weights from an nnscaler checkpoint of another plan and from a Hugging Face directory
            fabric.load_raw(os.path.join(root, "dp2.ckpt"), model)
            initial["dp2"] = full_weights(holder)
            fabric.load_raw(os.path.join(root, "hf"), model)
            initial["hf"] = full_weights(holder)
        out[name] = (torch.stack(losses), weights, reloaded, state["step"], state["pair"], left,
                     all(torch.equal(before[k], after[k]) for k in before), initial)
    return out if rank == 0 else None
