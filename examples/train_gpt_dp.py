"""The main job: a small GPT parallelized with the `dp` policy, trained on 2 CPU processes.

    python examples/train_gpt_dp.py [--nproc 2] [--steps 5] [--gen-savedir DIR]

Each process joins a gloo group, calls `parallelize()` (rank 0 traces and generates the code,
the others load it), and trains with a plain loop; every data-parallel replica gets its own slice
of the global batch. Rank 0 prints the loss of every step (averaged over replicas) and where the
generated code went.
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

GLOBAL_BATCH = 8


def worker(rank: int, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), RANK=str(rank),
                      WORLD_SIZE=str(args.nproc), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(args.nproc))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.nproc))
    dist.init_process_group("gloo", rank=rank, world_size=args.nproc)
    try:
        from nnscaler import ComputeConfig, build_optimizer, parallelize

        cfg = GPTConfig()
        torch.manual_seed(0)
        model = GPT(cfg)
        per_rank = GLOBAL_BATCH // args.nproc
        pm = parallelize(model, random_batch(0, per_rank, cfg), "dp",
                         ComputeConfig(1, args.nproc, trace_strategy="cpu"),
                         gen_savedir=args.gen_savedir, reuse="moo")
        optimizer = build_optimizer(pm, torch.optim.Adam, lr=1e-2)
        if rank == 0:
            print(f"generated code: {os.path.dirname(sys.modules[type(pm).__module__].__file__)}", flush=True)
        for step in range(args.steps):
            batch = random_batch(step, GLOBAL_BATCH, cfg)
            mine = {k: v[rank * per_rank:(rank + 1) * per_rank] for k, v in batch.items()}
            optimizer.zero_grad()
            loss = pm(**mine)
            loss.backward()
            optimizer.step()
            mean = loss.detach().clone()
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
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--gen-savedir", default="./.nnscaler")
    args = p.parse_args()
    if GLOBAL_BATCH % args.nproc:
        p.error(f"--nproc must divide the global batch size {GLOBAL_BATCH}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        args.port = s.getsockname()[1]
    print(f"training a {GPTConfig().n_layer}-layer GPT with policy 'dp' on {args.nproc} CPU processes (gloo)")
    mp.spawn(worker, args=(args,), nprocs=args.nproc)


if __name__ == "__main__":
    main()
