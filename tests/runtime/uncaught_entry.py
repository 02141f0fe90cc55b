"""Entry point of tests/runtime/test_failures_uncaught.py: one rank of a 2-process gloo job,
started as a plain ``python`` process as torchrun starts it (so an uncaught exception runs the
interpreter's ``sys.excepthook`` and ends the process).

    RANK=r WORLD_SIZE=2 MASTER_ADDR=... MASTER_PORT=... python uncaught_entry.py SCENARIO GEN_DIR OUT_DIR

Rank 1 raises, uncaught, where SCENARIO says (the lines marked ``# RAISES``); rank 0 writes what
it raised to ``OUT_DIR/rank0.json`` (JSON: type, message, and PeerFailedError's rank / died). The
excepthook is installed by building the ParallelModule (dp_between, pp_between), or by the
script's own `failures.install_excepthook()` call (before_parallelize): importing nnscaler does not.
"""
from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

import nnscaler  # noqa: F401 - imported first, as a training script does

NMICROS = 2


def _dp(gen_dir):
    import toy_models
    from nnscaler import ComputeConfig, build_optimizer, parallelize

    torch.manual_seed(0)
    pm = parallelize(toy_models.MLP(), toy_models.mlp_batch(0, 4), "dp", ComputeConfig(1, 2, trace_strategy="cpu"),
                     gen_savedir=gen_dir)
    opt = build_optimizer(pm, torch.optim.SGD, lr=0.1)
    for step in range(2):
        loss = pm(**toy_models.mlp_batch(step * 2 + dist.get_rank(), 4))
        if step == 1 and dist.get_rank() == 1:
            raise RuntimeError("the user's loop failed between forward and backward")  # RAISES dp_between
        loss.backward()  # rank 0 waits here for rank 1 in the gradient all-reduce
        opt.step()
        opt.zero_grad()


def _pp(gen_dir):
    from gpt import GPT, GPTConfig, random_batch
    from nnscaler import ComputeConfig, parallelize

    cfg = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)
    torch.manual_seed(0)
    compute = ComputeConfig(2, 2, trace_strategy="cpu", use_end2end=True,
                            pas_config={"pipeline_nmicros": NMICROS, "pipeline_scheduler": "1f1b"})
    pm = parallelize(GPT(cfg), random_batch(0, 2, cfg), "pp", compute, gen_savedir=gen_dir)
    for step in range(2):
        if step == 1 and dist.get_rank() == 1:
            raise RuntimeError("the user's loop failed between two pipeline steps")  # RAISES pp_between
        pm.train_step([random_batch(step * NMICROS + i, 2, cfg) for i in range(NMICROS)])


def _before(gen_dir):
    import toy_models
    from nnscaler import ComputeConfig, parallelize
    from nnscaler.runtime import failures

    failures.install_excepthook()  # parallelize installs it too, but rank 1 raises before that
    if dist.get_rank() == 1:
        raise ValueError("the data shard of this rank could not be read")  # RAISES before_parallelize
    parallelize(toy_models.MLP(), toy_models.mlp_batch(0, 4), "dp", ComputeConfig(1, 2, trace_strategy="cpu"),
                gen_savedir=gen_dir)


SCENARIOS = {"dp_between": _dp, "pp_between": _pp, "before_parallelize": _before}


def main():
    scenario, gen_dir, out_dir = sys.argv[1:4]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    from nnscaler.runtime import PeerFailedError
    out = {"error": None}
    try:
        SCENARIOS[scenario](gen_dir)
    except PeerFailedError as exc:  # rank 0: what it learnt about rank 1
        out = {"error": type(exc).__name__, "message": str(exc), "rank": exc.rank, "died": exc.died}
    except Exception as exc:  # noqa: BLE001 - rank 0 reports anything else for the test to show
        if dist.get_rank() == 1:
            raise
        out = {"error": type(exc).__name__, "message": str(exc)}
    with open(os.path.join(out_dir, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(out, f)
    from nnscaler.runtime.grid import RankGrid
    RankGrid.destroy_all()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
