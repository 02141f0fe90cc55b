"""The command's body: validate the config (and what it says about the disk, `prechecks`) before
any process starts, print it, or run (in this process under torchrun, or on ``--nproc N`` local
processes started through torch's own launcher, ``torch.distributed.run``)."""
from __future__ import annotations

import os
import sys
from typing import List, Optional

from ..config.argv import split_argv
from ..config.loading import dump_yaml
from ..config.trainer_args import TrainerArgs
from ..errors import NnScalerError, TrainerConfigError

__all__ = ["main"]


def _launch(nproc: int, argv: List[str]) -> int:
    """``torchrun --nproc_per_node N -m nnscaler.trainer ARGV`` (standalone rendezvous)."""
    from torch.distributed import run as torchrun
    args = ["--standalone", f"--nproc_per_node={nproc}", "-m", "nnscaler.trainer", *argv]
    threads = max(1, (os.cpu_count() or 1) // nproc)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))  # each rank: cores // ranks threads
    try:
        torchrun.main(args)
    except Exception as e:  # the workers' failure; their own output said why
        print(f"nnscaler: training failed on a worker process ({type(e).__name__}); see the worker output above",
              file=sys.stderr)
        return 1
    return 0


def _without_nproc(argv: List[str]) -> List[str]:
    out, skip = [], False
    for token in argv:
        if skip:
            skip = False
            continue
        if token == "--nproc":
            skip = True
            continue
        if token.startswith("--nproc="):
            continue
        out.append(token)
    return out


def main(argv: Optional[List[str]] = None, run_mode: Optional[str] = None) -> int:
    """Run the trainer command line; returns the exit code. Errors are one line on stderr."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        parsed = split_argv(argv)
        args = TrainerArgs.from_argv(argv, run_mode)
        if parsed.print_config:
            sys.stdout.write(dump_yaml(args.to_dict()))
            return 0
        launcher = parsed.nproc is not None and "RANK" not in os.environ
        if launcher and parsed.nproc != args.compute_config.runtime_ngpus:
            raise TrainerConfigError("compute_config.runtime_ngpus",
                                     f"is {args.compute_config.runtime_ngpus} but --nproc is {parsed.nproc}: make "
                                     f"them equal (e.g. --compute_config.runtime_ngpus {parsed.nproc})")
        from ..prechecks import check_paths, nothing_to_train
        check_paths(args)  # paths, resume_from, save_dir: before any worker starts or anything is written
        note = nothing_to_train(args)
        if note is not None:  # a finished run re-run: no worker starts, nothing is written
            if os.environ.get("RANK", "0") == "0":
                print(note)
            return 0
        if launcher:
            if args.run_mode == "run" or args.broadcast_strategy != "none":
                forwarded = _without_nproc(argv) + ([f"--run_mode={run_mode}"] if run_mode else [])
                return _launch(parsed.nproc, forwarded)
        if "RANK" in os.environ:
            threads = max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
            import torch
            torch.set_num_threads(threads)
        from ..trainer import Trainer
        Trainer(train_args=args).run()
        return 0
    except NnScalerError as e:
        rank = os.environ.get("RANK")
        prefix = f"[rank {rank}] " if rank not in (None, "0") else ""
        if rank in (None, "0") or not isinstance(e, TrainerConfigError):
            print(f"{prefix}error: {e}", file=sys.stderr)
        return 2 if isinstance(e, TrainerConfigError) else 1
