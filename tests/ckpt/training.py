"""The model, plans and training loop the checkpoint tests share (importable by spawned workers).

One GPT (tied embedding / head, no dropout), trained with Adam on a fixed global batch cut into
`NMICROS` micro-batches per data-parallel replica, through `train_step` for every plan so that
pipelined and plain plans compute the same numbers as one process on the whole batch."""
from __future__ import annotations

import torch
import torch.distributed as dist

from gpt import GPT, GPTConfig, random_batch

GPT_CFG = dict(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)
GLOBAL_BATCH = 8
NMICROS = 2
LR = 1e-3
SAVE_AT = 2  # steps before the checkpoint
STEPS = 4  # steps in all


def make_model(seed: int = 0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(**GPT_CFG))


def batch(step: int, n: int = GLOBAL_BATCH):
    return random_batch(step, n, GPTConfig(**GPT_CFG))


def micro_batches(step: int, dp_rank: int, dp: int):
    full = batch(step)
    per = GLOBAL_BATCH // dp
    mine = {k: v[dp_rank * per:(dp_rank + 1) * per] for k, v in full.items()}
    mb = per // NMICROS
    return [{k: v[i * mb:(i + 1) * mb] for k, v in mine.items()} for i in range(NMICROS)]


PLANS = {  # name -> (policy, plan_ngpus, extra ComputeConfig fields)
    "one": ("dp", 1, {}), "dp": ("dp", 1, {}), "tp": ("tp", None, {}), "tp-zero": ("tp", None, {"use_zero": True}),
    "pp": ("pp", None, {}), "dp-zero": ("dp", 1, {"use_zero": True}),
    "dp-zero3": ("dp", 1, {"use_zero": 3}), "tp-zero3": ("tp", None, {"use_zero": 3}),
}


def build(plan: str, plan_ngpus: int, world: int, gen_dir: str, seed: int = 0):
    """A parallelized GPT and its Adam optimizer (`seed` sets the initial weights)."""
    from nnscaler import ComputeConfig, build_optimizer, parallelize
    policy, fixed, extra = PLANS[plan]
    plan_ngpus = fixed or plan_ngpus
    pas = {"pipeline_nmicros": NMICROS, "pipeline_scheduler": "1f1b"} if policy == "pp" else {}
    cfg = ComputeConfig(plan_ngpus, world, trace_strategy="cpu", use_end2end=True, pas_config=pas, **extra)
    dp = world // plan_ngpus
    pm = parallelize(make_model(seed), micro_batches(0, 0, dp)[0], policy, cfg, gen_savedir=gen_dir,
                     instance_name=f"{plan.replace('-', '_')}_{plan_ngpus}_{world}")
    return pm, build_optimizer(pm, torch.optim.Adam, lr=LR)


def train(pm, opt, first: int, last: int):
    """Steps [first, last); the loss of each step averaged over the global batch."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    plan = pm.compute_config.plan_ngpus
    dp, dp_rank = world // plan, pm.rank // plan
    losses = []
    for step in range(first, last):
        opt.zero_grad()
        outputs = pm.train_step(micro_batches(step, dp_rank, dp))
        opt.scale_grads(1.0 / NMICROS)
        opt.step()
        loss = torch.stack([o.reshape(()) for o in outputs]).mean().reshape(1)
        if world > 1:
            dist.all_reduce(loss)
        losses.append(loss.item() / world)
    return losses


def shards(pm):
    """(full name, full shape, slices, value) of every parameter this rank holds (its whole local
    tensors: fully sharded parameters are gathered for it)."""
    with pm.unsharded():
        return [(e.full_name, e.full_shape, e.slices, getattr(pm, local).detach().clone())
                for local, e in pm.fullmap.items() if isinstance(getattr(pm, local), torch.nn.Parameter)]


def reference(steps: int = STEPS):
    """One process on the whole batch: per-step losses, parameters and Adam state after
    `SAVE_AT` steps and after `steps` steps."""
    model = make_model(0)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    losses, at_save = [], None
    for step in range(steps):
        if step == SAVE_AT:
            at_save = _snapshot(model, opt)
        loss = model(**batch(step))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, at_save, _snapshot(model, opt)


def _snapshot(model, opt):
    names = {id(p): n for n, p in model.named_parameters()}
    state = {names[id(p)]: {k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()
             if p in opt.state}
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, state


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Per-tensor norm of the difference relative to the reference's norm (at least 1, so that
    tensors near zero, e.g. a bias after two steps, are held to an absolute 1e-5)."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / max(b.norm().item(), 1.0)).item()
