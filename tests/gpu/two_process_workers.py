"""The workers of test_gpu_two_processes.py: two ranks on the one GPU, gloo over CUDA tensors."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from gpu_support import LR, device, full_params, gpt_batch, make_gpt, no_tf32, trace_strategy

STEPS, N = 3, 8


def _one_gpu():
    os.environ["LOCAL_RANK"] = "0"  # both ranks on cuda:0 (run_workers sets LOCAL_RANK = rank)
    if torch.cuda.is_available():
        torch.cuda.set_device(0)


def collectives(rank, world):
    """all_reduce, broadcast and list all_gather of CUDA tensors through the gloo group."""
    _one_gpu()
    dev = device()
    t = torch.full((4,), float(rank + 1), device=dev)
    dist.all_reduce(t)
    b = torch.full((3,), float(rank), device=dev)
    dist.broadcast(b, src=1)
    parts = [torch.empty(2, device=dev) for _ in range(world)]
    dist.all_gather(parts, torch.full((2,), float(rank), device=dev))
    return dict(device=str(t.device), sum=t.cpu(), bcast=b.cpu(), gathered=[p.cpu() for p in parts])


def plans(rank, world, gen_dir):
    """dp 2, tp 2 and megatron 2 on a GPT: per-step global losses and the full parameters."""
    _one_gpu()
    from nnscaler import ComputeConfig, build_optimizer, parallelize
    from parity import train_steps
    out = {}
    with no_tf32():
        for policy, plan in (("dp", 1), ("tp", 2), ("megatron", 2)):
            dp = world // plan
            cfg = ComputeConfig(plan, world, trace_strategy=trace_strategy())
            pm = parallelize(make_gpt(), gpt_batch(0, N // dp), policy, cfg, gen_savedir=gen_dir,
                             instance_name=f"{policy}{plan}")
            assert pm.device == device()
            opt = build_optimizer(pm, torch.optim.SGD, lr=LR)
            losses = train_steps(pm, opt, lambda step, n: {k: v.to(device()) for k, v in gpt_batch(step, n).items()},
                                 steps=STEPS, global_batch=N, dp_rank=rank // plan, dp=dp)
            shards = [(e.full_name, e.full_shape, e.slices, getattr(pm, local).detach().cpu().clone())
                      for local, e in pm.fullmap.items() if isinstance(getattr(pm, local), torch.nn.Parameter)]
            out[f"{policy}{plan}"] = (losses, shards)
    return out


def exact_dropout(rank, world, gen_dir, seed):
    """rng_mode="exact" at dp 2 with dropout: the losses of one process seeded with `seed`."""
    _one_gpu()
    import random_models
    from nnscaler import ComputeConfig, build_optimizer, parallelize
    from parity import train_steps
    cfg = ComputeConfig(1, world, trace_strategy=trace_strategy(), rng_mode="exact")
    torch.manual_seed(1 + rank)  # the ranks' own seeds must not matter
    pm = parallelize(random_models.make(), random_models.batch(0, N // world), "dp", cfg, gen_savedir=gen_dir,
                     instance_name="exact")
    pm.manual_seed(seed)
    opt = build_optimizer(pm, torch.optim.Adam, lr=1e-2)
    losses = train_steps(pm, opt, lambda step, n: {k: v.to(device()) for k, v in random_models.batch(step, n).items()},
                         steps=STEPS, global_batch=N, dp_rank=rank, dp=world)
    return losses, full_params(pm)
