"""Trainer: sets a run up from TrainerArgs and runs training, validation and checkpoints.

    trainer = Trainer(train_args=TrainerArgs.from_yaml("cfg.yaml"))   # or Trainer(argv=[...])
    trainer.run()

Data order: each rank reads ``DistributedSampler(dataset, num_replicas=dp, rank=rank //
plan_ngpus, **train_args)`` with ``set_epoch(epoch)``; a step takes ``grad_accumulation_steps``
consecutive micro-batches (an incomplete group at the end of an epoch is dropped).

This file is the loop and validation, written as the algorithm; the set-up before it and the
tear-down after it are `run_setup.RunSetup`, a base of `Trainer`.
"""
from __future__ import annotations

import math
import os
import signal
import time
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from nnscaler.ckpt import restore_rng_snapshot

from .checkpoints import ckpt_backend
from .config.trainer_args import TrainerArgs
from .data_position import samples_in_epoch, skip_per_rank
from .errors import TrainerError
from .hooks import HookChain
from .metrics import TrainStepMetrics, ValMetrics
from .moe import MoEMeter
from .preemption import PreemptionWatch
from .prechecks import check_paths
from .run_setup import RunSetup
from .state import TrainState
from .step import aggregate, train_step, val_step

__all__ = ["Trainer"]


class Trainer(RunSetup):
    """Train the model TrainerArgs describes (see the module docstring and docs/trainer.md)."""

    def __init__(self, argv: Optional[List[str]] = None, *, train_args: Optional[TrainerArgs] = None):
        if train_args is None:
            train_args = TrainerArgs.from_argv(argv or [])
        self.train_args = train_args.validate()
        self.state = TrainState()
        self.model = self.optimizer = self.lr_scheduler = None
        self.train_loader = self.val_loader = None
        self.loggers: list = []
        self.hooks = HookChain([])
        self.rank, self.world_size = 0, 1
        self._owns_group = False
        self.aggregate_outputs_fn = None
        self._val_step: Optional[int] = None
        self._moe: Optional[MoEMeter] = None  # mixture-of-experts models: aux loss, expert load

    # -- entry points ---------------------------------------------------------------------------
    def run(self) -> None:
        """Compile (``run_mode: compile``) or set up and train; always tears down what it built."""
        ok = False
        try:
            check_paths(self.train_args)  # before anything is written, on every rank
            if self.train_args.run_mode == "compile":
                self._compile()
            else:
                self._setup()
                self.hooks.after_setup(self)
                self._train()
                self.hooks.on_finalize(self)
            ok = True
        finally:
            self._teardown(ok)

    @classmethod
    def merge_checkpoint(cls, checkpoint_files: List[str], output_file: str) -> None:
        """Merge a sharded / deduped checkpoint (its directory, or its rank files) into a merged
        one at `output_file` (a directory), offline, through nnscaler.ckpt.merge."""
        paths = [checkpoint_files] if isinstance(checkpoint_files, (str, os.PathLike)) else list(checkpoint_files)
        dirs = {str(p) if os.path.isdir(p) else os.path.dirname(os.path.abspath(p)) for p in paths}
        if len(dirs) != 1:
            raise TrainerError(f"merge_checkpoint: the files come from {len(dirs)} directories; give the files of "
                               f"one checkpoint (or its directory)")
        ckpt_backend().merge(dirs.pop(), output_file)

    # -- the loop -------------------------------------------------------------------------------
    def _train(self) -> None:
        """The algorithm. Each helper below is one operation with its hooks around it."""
        args = self.train_args
        self._resume()
        self.hooks.on_train_start(self)
        with PreemptionWatch() as preemption:  # SIGTERM / SIGINT: stop after the step in progress
            while not self._finished():
                epoch = self._start_epoch()
                for idx, batches in self._step_batches():
                    if self._step_limit_reached():
                        break
                    metrics, agg = self._train_step(epoch, idx, batches)
                    self._lr_step("step")
                    self._log_step(epoch, idx, metrics, agg)
                    val_loss = self._validate_if_due(self.state.step, args.val_every_n_train_steps)
                    if self.checkpoints.due_after_step(self.state.step):
                        self.save_checkpoint(val_loss)
                    if preemption.requested():
                        return self._stop_preempted(preemption)
                if self._step_limit_reached() and self.state.idx_in_epoch < self.steps_per_epoch:
                    break  # max_train_steps ended the run inside this epoch
                self._end_epoch(epoch)
                self._lr_step("epoch")
                val_loss = self._validate_if_due(epoch + 1, args.val_every_n_epochs)
                if self.checkpoints.due_after_epoch(epoch + 1):
                    self.save_checkpoint(val_loss)
                if preemption.requested():
                    return self._stop_preempted(preemption)
        self.hooks.on_train_end(self)
        if self.checkpoints.due_at_end(self.state.step):
            self.save_checkpoint()  # the final state (nothing when this step is saved already)
        self.checkpoints.close()

    def _resume(self) -> None:
        """Continue from ``checkpoint.resume_from`` when it names a checkpoint: the manager loads
        it; the counters, on_load_checkpoint and, last, the RNG states (so neither set-up's nor the
        hooks' random draws shift the streams) are applied here."""
        resumed = self.checkpoints.resume(self)
        if resumed is not None:
            self.state = resumed.state
            self.hooks.on_load_checkpoint(self, resumed.extra)
            for line in resumed.messages:
                self.console.line(line)
            if resumed.rng is not None:
                restore_rng_snapshot(resumed.rng, self.model)
        self.console.set_completed(self.state.step)

    def _stop_preempted(self, preemption: PreemptionWatch) -> None:
        """Every rank got (or learnt of) a preemption signal: commit a checkpoint of the step just
        taken (unless saved already) and say where training stopped; the run then ends normally."""
        state = self.state
        if self.checkpoints.due_at_end(state.step):
            self.save_checkpoint()
            saved = f"checkpoint {self.checkpoints.path_for(state.current_epoch, state.step)} committed; the same " \
                    f"command with checkpoint.resume_from: auto continues"
        else:
            saved = "nothing saved (checkpoint.no_save)"
        self.checkpoints.close()
        name = signal.Signals(preemption.received).name if preemption.received else "a signal another rank got"
        self.console.line(f"preempted: stopped at step {state.step} (epoch {state.current_epoch}) on {name}; {saved}")

    def _finished(self) -> bool:
        args = self.train_args
        return self._step_limit_reached() or (args.max_epochs is not None and self.state.epoch >= args.max_epochs)

    def _step_limit_reached(self) -> bool:
        return self.train_args.max_train_steps is not None and self.state.step >= self.train_args.max_train_steps

    def _start_epoch(self) -> int:
        """Point the data at the next position (mid-epoch after a resume); on_epoch_start when the
        epoch starts from its beginning. Returns the epoch."""
        args, epoch = self.train_args, self.state.epoch
        self.train_sampler.set_epoch(epoch)
        done = samples_in_epoch(self.state.idx_in_epoch, args.resolved_global_batch_size)
        self.train_sampler.skip(skip_per_rank(done, args.dp_size))  # on any dp: data_position
        self._generator.manual_seed((args.seed or 0) * 100003 + epoch)
        if self.state.idx_in_epoch == 0:
            self.hooks.on_epoch_start(self, epoch)
        return epoch

    def _step_batches(self) -> Iterator[Tuple[int, List[Any]]]:
        """(index in the epoch, micro-batches) of each step left in the epoch: ``update_freq``
        consecutive micro-batches each; an incomplete group at the end is dropped."""
        gas, batches, idx = self.train_args.update_freq, [], self.state.idx_in_epoch
        for batch in self.train_loader:
            batches.append(batch)
            if len(batches) == gas:
                yield idx, batches
                batches, idx = [], idx + 1

    def _train_step(self, epoch: int, idx: int, batches: List[Any]) -> Tuple[TrainStepMetrics, Any]:
        """on_step_start, one optimizer step (`step.train_step`, with its hooks), the counters;
        returns the step's metrics (the LR it used; a mixture-of-experts model's aux loss and expert
        load) and aggregated outputs."""
        self.hooks.on_step_start(self, epoch, idx)
        if self._moe is not None:
            self._moe.begin()
        start = time.perf_counter()
        outputs, agg, loss, gnorm = train_step(self, batches)
        elapsed = time.perf_counter() - start
        moe = self._moe.end(outputs) if self._moe is not None else None  # collective
        self.state.step += 1
        self.state.idx_in_epoch = idx + 1
        self.state.samples_in_epoch = samples_in_epoch(idx + 1, self.train_args.resolved_global_batch_size)
        self.state.last_train_loss = loss
        lr = self.optimizer.param_groups[0]["lr"] if self.optimizer.param_groups else 0.0
        samples, tokens = self.train_args.resolved_global_batch_size, getattr(agg, "num_tokens", None)
        metrics = TrainStepMetrics(epoch=epoch, step=self.state.step, train_loss=loss, lr=lr, gnorm=gnorm,
                                   samples_per_s=samples / elapsed if elapsed > 0 else None,
                                   tokens_per_s=tokens / elapsed if tokens and elapsed > 0 else None,
                                   step_time_s=elapsed, memory_mb=_memory_mb(), moe=moe)
        return metrics, agg

    def _lr_step(self, interval: str) -> None:
        """Step the LR scheduler when its ``interval`` is this one (``step`` or ``epoch``)."""
        if self.lr_scheduler is not None and self.train_args.lr_scheduler.interval == interval:
            self.lr_scheduler.step()

    def _log_step(self, epoch: int, idx: int, metrics: TrainStepMetrics, agg: Any) -> None:
        """before_log_train_metrics (may edit them), the loggers and the console, on_step_end."""
        self.hooks.before_log_train_metrics(self, metrics, agg)
        self._log(metrics.scalars(), "train")
        self.console.train_step(metrics, self.state.step)
        self.hooks.on_step_end(self, epoch, idx, metrics, agg)

    def _end_epoch(self, epoch: int) -> None:
        """on_epoch_end; the data position moves to the next epoch's start."""
        self.hooks.on_epoch_end(self, epoch)
        self.state.epoch, self.state.idx_in_epoch, self.state.samples_in_epoch = epoch + 1, 0, 0

    def _validate_if_due(self, count: int, every: Optional[int]) -> Optional[float]:
        """The validation loss when `count` (steps or epochs) is a multiple of `every`, else None."""
        return self.validate() if every and count % every == 0 else None

    # -- validation -----------------------------------------------------------------------------
    def validate(self) -> Optional[float]:
        """Validation loss (mean over all batches of all replicas); None without val data."""
        if self.val_loader is None:
            return None
        if self._val_step == self.state.step:  # validated at this step already (steps and epoch end)
            return self.state.last_val_loss
        args = self.train_args
        self.hooks.on_val_start(self)
        self.model.eval()
        self.val_sampler.set_epoch(0)
        outputs: List[Any] = []
        real = getattr(self.val_sampler.sampler, "real_batches", None)  # ValidationSampler: padding after
        for i, batch in enumerate(self.val_loader):
            if real is None and args.max_val_steps is not None and i >= args.max_val_steps:
                break
            out = val_step(self, [batch])
            if real is None or i < real:
                outputs.extend(out)
        self.model.train()
        agg = aggregate(self, outputs)
        val_loss = agg.loss_sum / agg.num_batches if agg.num_batches else math.nan
        self.hooks.after_aggregate_val_step_outputs(self, agg, val_loss)
        metrics = ValMetrics(epoch=self.state.current_epoch, step=self.state.step, val_loss=val_loss,
                             num_batches=agg.num_batches or 0)
        self.hooks.before_log_val_metrics(self, metrics)
        self._log(metrics.scalars(), "val")
        self.console.val(metrics)
        self.state.last_val_loss = val_loss
        self._val_step = self.state.step
        self.hooks.on_val_end(self, val_loss)
        return val_loss

    # -- checkpoints ----------------------------------------------------------------------------
    def save_checkpoint(self, val_loss: Optional[float] = None) -> Optional[str]:
        """Validate (when no loss is given), then save through nnscaler.ckpt (collective); returns
        the checkpoint directory, or None when this step is saved already. With
        ``checkpoint.async_save`` it is committed at the next save or at the end of the run
        (``self.checkpoints.wait()`` waits for it)."""
        saved = self.checkpoints.save(self, val_loss)
        if saved is None:
            return None
        self.state.best_val_loss = saved.best_val_loss
        return saved.path

    def _log(self, scalars: Dict[str, float], tag: str) -> None:
        for logger in self.loggers:
            logger.log_metrics(scalars, self.state.step, tag)


def _memory_mb() -> Optional[float]:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / 2 ** 20
    try:
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KB on Linux
    except (ImportError, OSError):
        return None
