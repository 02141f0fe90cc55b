"""A small GPT cut into a pipeline with the `pp` (or `hybrid`) policy, trained on CPU processes.

    python examples/train_gpt_pp.py [--nproc 2] [--plan 2] [--scheduler 1f1b] [--nmicros 4]
    python examples/train_gpt_pp.py --nproc 4 --plan 4 --policy hybrid --pp-size 2   # pp 2 x tp 2

`--plan` devices hold one copy of the model (cut into stages at the GPT's `Block` modules);
`--nproc // --plan` copies train data-parallel. Every step hands `train_step` the step's
micro-batches; rank 0 prints the mean loss and, once, the schedule's order of steps per device.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt import GPT, GPTConfig, random_batch  # noqa: E402

GLOBAL_BATCH = 16


def pas_config(args) -> dict:
    pas = {"pipeline_nmicros": args.nmicros, "pipeline_scheduler": args.scheduler, "pipeline_pivots": "Block"}
    if args.policy == "hybrid":
        pp = args.pp_size or args.plan
        pas.update(pipeline_nstages=2 * pp if args.scheduler == "1f1b_interleaved" else pp, pp_size=pp)
    return pas


def worker(rank: int, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), RANK=str(rank),
                      WORLD_SIZE=str(args.nproc), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(args.nproc))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.nproc))
    dist.init_process_group("gloo", rank=rank, world_size=args.nproc)
    try:
        from nnscaler import ComputeConfig, build_optimizer, parallelize

        cfg = GPTConfig(n_layer=4)
        torch.manual_seed(0)
        dp = args.nproc // args.plan
        per_replica = GLOBAL_BATCH // dp
        micro = per_replica // args.nmicros
        pm = parallelize(GPT(cfg), random_batch(0, micro, cfg), args.policy,
                         ComputeConfig(args.plan, args.nproc, trace_strategy="cpu", use_end2end=True,
                                       pas_config=pas_config(args)),
                         gen_savedir=args.gen_savedir, reuse="override")
        optimizer = build_optimizer(pm, torch.optim.Adam, lr=1e-2)
        if rank == 0:
            print(f"generated code: {os.path.dirname(sys.modules[type(pm).__module__].__file__)}")
            schedule = pm.PIPELINE.schedule()  # each pipeline device's forward (F) / backward (B) order
            for device in range(schedule.ndevices):
                steps = " ".join(f"{a.kind}{a.micro}" for a in schedule.actions(device))
                print(f"dev{device}: {steps}", flush=True)
        replica = rank // args.plan
        for step in range(args.steps):
            batch = random_batch(step, GLOBAL_BATCH, cfg)
            mine = {k: v[replica * per_replica:(replica + 1) * per_replica] for k, v in batch.items()}
            samples = [{k: v[i * micro:(i + 1) * micro] for k, v in mine.items()} for i in range(args.nmicros)]
            optimizer.zero_grad()
            losses = pm.train_step(samples)
            optimizer.scale_grads(1 / args.nmicros)  # summed over micro-batches -> their mean
            optimizer.step()
            mean = torch.stack(losses).mean().reshape(1)
            dist.all_reduce(mean)
            if rank == 0:
                print(f"step {step}: loss {mean.item() / args.nproc:.4f}", flush=True)
        dist.barrier()  # nobody tears its connections down while a peer still talks on them
    finally:
        from nnscaler.runtime import RankGrid
        RankGrid.destroy_all()  # nnscaler's groups first, then the default one
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--plan", type=int, default=2)
    p.add_argument("--policy", choices=("pp", "hybrid"), default="pp")
    p.add_argument("--pp-size", type=int, default=None, help="hybrid: pipeline devices (default --plan)")
    p.add_argument("--scheduler", default="1f1b")
    p.add_argument("--nmicros", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--gen-savedir", default="./.nnscaler")
    args = p.parse_args()
    if args.nproc % args.plan or GLOBAL_BATCH % ((args.nproc // args.plan) * args.nmicros):
        p.error(f"--plan must divide --nproc, and (nproc // plan) * nmicros must divide {GLOBAL_BATCH}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        args.port = s.getsockname()[1]
    print(f"training a 4-layer GPT with policy {args.policy!r} ({args.scheduler}) on {args.nproc} CPU processes")
    mp.spawn(worker, args=(args,), nprocs=args.nproc)


if __name__ == "__main__":
    main()
