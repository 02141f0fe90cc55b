"""The command's body: validate the config (and what it says about the disk, `prechecks`) before
any process starts, print it, or run (in this process under torchrun, or on ``--nproc N`` local
processes started through torch's own launcher, ``torch.distributed.run``, which restarts them
up to ``--max_restarts N`` times after a failure).

Exit codes: 0 finished (or stopped by a preemption signal the workers received: they committed a
checkpoint), 1 failed, 2 a bad config (found before any worker starts, or a setting the engine
refuses in the workers: a policy's `PlanError`, a `ConfigError`; rank 0 prints it, one line),
`PREEMPTED_EXIT` (143) the launcher itself received SIGTERM (it forwards it; the workers finish
their step, commit a checkpoint and exit), 130 the same for SIGINT (Ctrl-C) or an interrupt
outside the training loop (one line says whether a checkpoint was committed; no traceback)."""
from __future__ import annotations

import logging
import os
import signal
import sys
from typing import List, Optional, Sequence, Tuple

from ..config.argv import split_argv
from ..config.loading import dump_yaml
from ..config.trainer_args import TrainerArgs
from ..errors import NnScalerError, TrainerConfigError
from .worker_env import worker_env

__all__ = ["main", "PREEMPTED_EXIT"]

PREEMPTED_EXIT = 128 + signal.SIGTERM  # 143: what a shell reports for a process SIGTERM ended


def _launch(nproc: int, argv: List[str], max_restarts: int = 0,
            entry: Sequence[str] = ("-m", "nnscaler.trainer")) -> int:
    """``torchrun --nproc_per_node N --max-restarts R -m nnscaler.trainer ARGV`` (standalone
    rendezvous; `entry` replaces ``-m nnscaler.trainer``), the workers' environment from
    `worker_env` (threads, glibc's malloc thresholds). Torch's agent forwards SIGTERM to the workers
    and gives them ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` seconds (30 by default) before it kills them."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    args = ["--standalone", f"--nproc_per_node={nproc}", f"--max-restarts={max_restarts}", *entry, *argv]
    worker_env(nproc)  # each rank: cores // ranks threads; freed memory handed back
    agent_log = _AgentLog(logging.getLogger("torch.distributed.elastic.multiprocessing.api"))
    try:
        torchrun.main(args)
    except SignalException as e:  # the agent forwarded it and waited for the workers
        name = signal.Signals(e.sigval).name if isinstance(e.sigval, int) else str(e.sigval)
        print(f"nnscaler: stopped by {name}: forwarded to the workers, which stop after their step and commit a "
              f"checkpoint (their output says the step; the agent kills them after TORCH_ELASTIC_SHUTDOWN_TIMEOUT "
              f"seconds, 30 by default); the same command with checkpoint.resume_from: auto continues",
              file=sys.stderr)
        return PREEMPTED_EXIT if e.sigval == signal.SIGTERM else 128 + int(e.sigval)
    except Exception as e:  # the workers' failure; their own output said why
        first = e.get_first_failure()[1] if hasattr(e, "get_first_failure") else None
        if getattr(first, "exitcode", None) == CONFIG_EXIT:  # a bad setting: rank 0 printed it, one line
            agent_log.close(emit=False)
            return CONFIG_EXIT
        print(f"nnscaler: training failed on a worker process ({type(e).__name__}); see the worker output above",
              file=sys.stderr)
        return 1
    finally:
        agent_log.close(emit=True)
    return 0


CONFIG_EXIT = 2


class _AgentLog(logging.Filter):
    """On torch's agent logger while the workers run: when a worker exits on a bad setting
    (exit code `CONFIG_EXIT`, its one-line error printed), the agent's records of it (the
    'Sending process N closing signal' warnings to the other workers, then 'failed (exitcode: 2)')
    are dropped; every other record passes, the warnings held only until the agent's next record."""

    def __init__(self, logger: logging.Logger):
        super().__init__()
        self.logger, self.held, self.replaying = logger, [], False
        logger.addFilter(self)

    def filter(self, record: logging.LogRecord) -> bool:
        if self.replaying:
            return True
        message = record.getMessage()
        if message.startswith("Sending process "):
            self.held.append(record)
            return False
        self._release(emit=not message.startswith(f"failed (exitcode: {CONFIG_EXIT})"))
        return not message.startswith(f"failed (exitcode: {CONFIG_EXIT})")

    def _release(self, emit: bool) -> None:
        held, self.held = self.held, []
        if emit:
            self.replaying = True
            try:
                for record in held:
                    self.logger.handle(record)
            finally:
                self.replaying = False

    def close(self, emit: bool) -> None:
        self._release(emit)
        self.logger.removeFilter(self)
_RELAYED = "rank 0 failed to generate code: "  # GenerationError: rank 0's failure, raised on the other ranks


def _config_errors() -> tuple:
    """The kinds of a bad setting: the Trainer's own, and what the engine refuses (ConfigError, a
    policy's PlanError)."""
    from nnscaler.ir import ConfigError
    from nnscaler.policies import PlanError
    return TrainerConfigError, ConfigError, PlanError


def _config_error(e: BaseException) -> bool:
    return isinstance(e, _config_errors())


def _config_error_name(name: str) -> bool:
    """Whether `name` is the class name of a bad-setting error (or of a subclass imported here)."""
    kinds, seen = list(_config_errors()), set()
    while kinds:
        kind = kinds.pop()
        if kind not in seen:
            seen.add(kind)
            kinds.extend(kind.__subclasses__())
    return name in {k.__name__ for k in seen}


def _report(e: NnScalerError) -> int:
    """Print a worker's (or the single process's) error, one line; returns the exit code. A
    TrainerConfigError (every rank raises it) and rank 0's generation failure (the other ranks
    raise it too, as a GenerationError) are printed by rank 0 only."""
    rank = os.environ.get("RANK")
    text = str(e)
    if rank not in (None, "0") and text.startswith(_RELAYED):  # rank 0 printed the cause; its name
        name = text[len(_RELAYED):].split(":", 1)[0]             # says whether it was a bad setting
        return CONFIG_EXIT if _config_error_name(name) else 1
    if rank in (None, "0") or not isinstance(e, TrainerConfigError):
        prefix = f"[rank {rank}] " if rank not in (None, "0") else ""
        print(f"{prefix}error: {text}", file=sys.stderr)
    return CONFIG_EXIT if _config_error(e) else 1


def _without_option(argv: List[str], name: str) -> List[str]:
    """`argv` without ``name VALUE`` / ``name=VALUE``."""
    out, skip = [], False
    for token in argv:
        if skip:
            skip = False
            continue
        if token == name:
            skip = True
            continue
        if token.startswith(name + "="):
            continue
        out.append(token)
    return out


def _without_nproc(argv: List[str]) -> List[str]:
    return _without_option(argv, "--nproc")


def _max_restarts(argv: List[str]) -> Tuple[Optional[int], List[str]]:
    """``--max_restarts N`` (or ``--max-restarts``) out of `argv`: (N or None, the rest)."""
    value: Optional[str] = None
    rest = list(argv)
    for name in ("--max_restarts", "--max-restarts"):
        for i, token in enumerate(rest):
            if token == name:
                if i + 1 >= len(rest):
                    raise TrainerConfigError("", f"{name} needs a value (restarts after a failure, e.g. {name} 3)")
                value = rest[i + 1]
            elif token.startswith(name + "="):
                value = token.partition("=")[2]
        rest = _without_option(rest, name)
    if value is None:
        return None, rest
    if not value.isdigit():
        raise TrainerConfigError("", f"--max_restarts must be a non-negative integer, got {value!r}")
    return int(value), rest


def main(argv: Optional[List[str]] = None, run_mode: Optional[str] = None) -> int:
    """Run the trainer command line; returns the exit code. Errors are one line on stderr."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        max_restarts, argv = _max_restarts(argv)
        if max_restarts is not None and "RANK" in os.environ:
            raise TrainerConfigError("", "--max_restarts restarts the processes `nnscaler train` starts itself; under "
                                         "torchrun give torchrun --max-restarts N instead (its agent restarts them)")
        parsed = split_argv(argv)
        args = TrainerArgs.from_argv(argv, run_mode)
        if parsed.print_config:
            sys.stdout.write(dump_yaml(args.to_dict()))
            return 0
        if max_restarts is not None and parsed.nproc is None:  # restarts need torch's agent: it starts them
            parsed.nproc = args.compute_config.runtime_ngpus
        ckpt = args.checkpoint
        if max_restarts and not ckpt.no_save and ckpt.resume_from not in ("auto", "last"):
            raise TrainerConfigError("checkpoint.resume_from",
                                     f"is {ckpt.resume_from!r} but --max_restarts {max_restarts} restarts the workers "
                                     f"with this config: set it to auto (--checkpoint.resume_from auto) so that "
                                     f"each restart resumes from the newest checkpoint")
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
                return _launch(parsed.nproc, forwarded, max_restarts or 0)
        if "RANK" in os.environ:
            threads = max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
            import torch
            torch.set_num_threads(threads)
        from ..trainer import Trainer
        Trainer(train_args=args).run()
        return 0
    except NnScalerError as e:
        return _report(e)
    except KeyboardInterrupt:  # SIGINT before or after the training loop (inside it, it stops the run)
        if os.environ.get("RANK", "0") == "0":
            print("nnscaler: interrupted (SIGINT) outside the training steps: nothing committed since the last "
                  "checkpoint", file=sys.stderr)
        return 128 + signal.SIGINT
