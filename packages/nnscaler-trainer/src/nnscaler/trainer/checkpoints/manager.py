"""CheckpointManager: the one owner of a run's checkpoints. It decides when a checkpoint is due,
builds what one holds (the Trainer's record in ``extra``, then the ``on_save_checkpoint`` hooks),
writes it through nnscaler.ckpt, moves ``last`` / ``best`` (one rule: `is_better`), prunes to
``keep_last_n_checkpoints``, and loads a checkpoint back for a resume, returning what the Trainer
applies (`Resumed`).

With ``checkpoint.async_save: true`` a save returns once the state is copied (nnscaler.ckpt's
`async_save`) and the manager keeps one pending record (path, step, loss); ``last`` / ``best``
move and pruning runs only once that checkpoint is committed: in `wait`, which the next save, the
end of the run (`close`) and a preemption exit call. Until then the listing (and so
``resume_from: auto``) cannot see it: nnscaler.ckpt writes into a ``.<name>.writing-<token>``
sibling and renames it at the commit. At set-up (`prepare`) every rank makes its background save
process and shared buffer (`prepare_async_save`), so the first save blocks no longer than the later.

One run per step directory: a run never writes a step that exists (it skips the steps it saved or
resumed from itself, and refuses any other), and never saves a step older than a checkpoint in
save_dir, so ``last`` never moves back. The launcher's pre-checks (`nnscaler.trainer.prechecks`)
refuse such runs before any worker starts; the checks here hold for every other way in.
"""
from __future__ import annotations

import os
import shutil
import warnings
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch.distributed as dist
from nnscaler.ckpt import AsyncSaveWarning, decode_extra, encode_extra, rng_snapshot

from ..config.values import build_args
from ..data_position import resumed_step_in_epoch, samples_in_epoch
from ..errors import TrainerConfigWarning, TrainerError
from ..state import TrainState
from .layout import (CONFIG_FILE, POINTERS, TRAINER_KEY, checkpoint_name, checkpoint_step, ckpt_backend,
                     list_checkpoints, point, pointed, resolve_resume)

__all__ = ["CheckpointManager", "Saved", "Pending", "Resumed", "is_better"]


def is_better(val_loss: Optional[float], best: Optional[float]) -> bool:
    """Whether a checkpoint ranked by `val_loss` becomes the best one, given the best loss so far:
    the lowest loss wins, a tie goes to the newer checkpoint, and no loss never wins."""
    return val_loss is not None and (best is None or val_loss <= best)


@dataclass(frozen=True)
class Saved:
    """A checkpoint written by `CheckpointManager.save`."""

    path: str  # committed, or (checkpoint.async_save) being written until the manager's next wait()
    val_loss: Optional[float]  # the loss that ranked it (validation, else training)
    best_val_loss: Optional[float]  # the best loss after this save: val_loss when this one is the best


@dataclass(frozen=True)
class Pending:
    """An asynchronous save not known to be committed yet: its handle and what `wait` finishes."""

    handle: Any  # nnscaler.ckpt.AsyncSave
    path: str
    step: int
    val_loss: Optional[float]
    best: bool  # it becomes ``best`` once committed


@dataclass(frozen=True)
class Resumed:
    """What `CheckpointManager.resume` loaded; model, optimizer, LR scheduler and grad scaler hold
    their states already, the rest is for the Trainer to apply."""

    path: str
    state: TrainState  # counters and data position
    extra: Dict[str, Any]  # the checkpoint's whole extra (``on_load_checkpoint`` gets it)
    rng: Optional[tuple]  # nnscaler.ckpt.rng_snapshot to restore right before training starts; None: afresh
    messages: Tuple[str, ...]  # console lines (rank 0 prints them)


class CheckpointManager:
    """Saves, finds and loads the checkpoints of one run (see the module docstring). `config` is
    the run's CheckpointConfig; `config_yaml` is saved in each checkpoint as ``train_config.yaml``."""

    def __init__(self, config, config_yaml: Optional[str] = None):
        self.config = config
        self.save_dir = config.save_dir
        self.config_yaml = config_yaml
        self.rank, self.world = _rank_world()
        self._own_steps: set = set()  # steps this run saved, or resumed from: saved already
        self.pending: Optional[Pending] = None  # the asynchronous save in flight (checkpoint.async_save)

    # -- when ---------------------------------------------------------------------------------
    def due_after_step(self, step: int) -> bool:
        """A checkpoint is due after optimizer step `step` (``every_n_train_steps``)."""
        return not self.config.no_save and _every(self.config.every_n_train_steps, step)

    def due_after_epoch(self, epochs_done: int) -> bool:
        """A checkpoint is due after `epochs_done` whole epochs (``every_n_epochs``)."""
        return not self.config.no_save and _every(self.config.every_n_epochs, epochs_done)

    def due_at_end(self, step: int) -> bool:
        """The final state is saved when training took a step (it is skipped when saved already)."""
        return not self.config.no_save and step > 0

    # -- naming -------------------------------------------------------------------------------
    def path_for(self, epoch: int, step: int) -> str:
        return os.path.join(self.save_dir, checkpoint_name(epoch, step))

    def saved(self) -> List[Tuple[int, int, str]]:
        """(epoch, step, path) of every numbered checkpoint, oldest first."""
        return list_checkpoints(self.save_dir)

    def has_step(self, step: int) -> bool:
        return any(s == step for _, s, _ in self.saved())

    def resumed_at(self, step: int) -> None:
        """This run continues from a checkpoint of `step`: that step counts as saved."""
        self._own_steps.add(step)

    def check_step(self, step: int) -> bool:
        """False when this run saved (or resumed from) `step` already: nothing to write. Raises
        when save_dir holds another run's checkpoint of this step or of a later one."""
        if step in self._own_steps:
            return False
        taken = [p for _, s, p in self.saved() if s >= step]
        for name in POINTERS:
            link = os.path.join(self.save_dir, name)
            later = checkpoint_step(link) if os.path.exists(link) else None
            if later is not None and later >= step and not os.path.islink(link):
                taken.append(link)
        if taken:
            raise TrainerError(f"checkpoint: cannot save step {step} in {self.save_dir}: it holds "
                               f"{', '.join(os.path.basename(p) for p in taken)} from another run (a step directory "
                               f"never holds two runs, and last never moves back); resume that run "
                               f"(checkpoint.resume_from: auto), or use a new or empty checkpoint.save_dir")
        return True

    # -- saving -------------------------------------------------------------------------------
    def prepare(self, model, optimizer) -> None:
        """With ``checkpoint.async_save`` (and saving on): start each rank's background save
        process and make its shared buffer now, sized for the model and the optimizer's state
        after its first step (nnscaler.ckpt's `prepare_async_save`), so the run's first checkpoint
        blocks training no longer than the later ones. Every rank calls it at set-up, once the
        optimizer exists (collective where parameters are fully sharded)."""
        if self.config.async_save and not self.config.no_save:
            _async_backend("prepare_async_save").prepare_async_save(model, optimizer)

    def save(self, trainer, val_loss: Optional[float] = None) -> Optional[Saved]:
        """Save the running `trainer` (collective): validate when no loss is given (the training
        loss ranks checkpoints without validation data), record the Trainer's state in ``extra``,
        call ``on_save_checkpoint``, write, move last / best, prune (with async_save: start the
        write; last / best and pruning wait for its commit, see `wait`). None when this run saved this
        step already; refuses (TrainerError, nothing written) a step another run's checkpoint holds."""
        state = trainer.state
        if not self.check_step(state.step):
            return None  # saved (or resumed from) by this run: a finished run re-run rewrites nothing
        if val_loss is None:
            val_loss = trainer.validate()
        if val_loss is None:
            val_loss = state.last_train_loss
        better = is_better(val_loss, state.best_val_loss)
        best = val_loss if better else state.best_val_loss
        extra = {TRAINER_KEY: _trainer_record(trainer, val_loss, best)}
        trainer.hooks.on_save_checkpoint(trainer, extra)
        path = self._write(trainer.model, trainer.optimizer, state.current_epoch, state.step, extra, better, val_loss)
        return Saved(path, val_loss, best)

    def _write(self, model, optimizer, epoch: int, step: int, extra: Dict[str, Any], best: bool,
               val_loss: Optional[float]) -> str:
        self.wait()  # the save in flight is committed, and its last / best / pruning done
        os.makedirs(self.save_dir, exist_ok=True)
        _barrier()  # every rank has seen the same listing before anyone writes
        path = self.path_for(epoch, step)
        files = {CONFIG_FILE: self.config_yaml} if self.config_yaml is not None else None
        if self.config.async_save:
            handle = _async_backend("async_save").async_save(path, model, optimizer, kind=self.config.save_type,
                                                             extra=extra, files=files)
            self._own_steps.add(step)
            self.pending = Pending(handle, path, step, val_loss, best)
            return path
        ckpt_backend().save(path, model, optimizer, kind=self.config.save_type, extra=extra, files=files)
        self._own_steps.add(step)
        if self.rank == 0:
            self._committed(path, best)
        _barrier()
        return path

    def _committed(self, path: str, best: bool) -> None:
        """Rank 0, once `path` is committed: move last / best to it, prune."""
        if self.config.save_last:
            point(self.save_dir, "last", path, self.config.symlink_best_and_last)
        if self.config.save_best and best:
            point(self.save_dir, "best", path, self.config.symlink_best_and_last)
        self._prune()

    def _prune(self) -> None:
        """Keep the newest keep_last_n_checkpoints numbered checkpoints, and what last / best link to."""
        keep = self.config.keep_last_n_checkpoints
        if not keep:
            return
        protected = pointed(self.save_dir)
        for _, _, path in self.saved()[:-keep]:
            if os.path.realpath(path) not in protected:
                shutil.rmtree(path, ignore_errors=True)

    def wait(self) -> None:
        """Return when every save started so far is committed, with last / best moved and the
        pruning done for it (collective when a save is in flight: every rank calls it at the same
        point). Raises the save's CheckpointError, on every rank, when it failed."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        pending.handle.wait()
        if self.rank == 0:
            self._committed(pending.path, pending.best)
        _barrier()

    def close(self, failed: bool = False) -> None:
        """Finish the save in flight; the run calls it before it exits. `failed`: the run is
        failing (the ranks may be anywhere): no collective, no error raised; when the save
        commits all the same, rank 0 still moves last / best and prunes (else a warning)."""
        if not failed:
            self.wait()
            return
        pending, self.pending = self.pending, None
        if pending is None:
            return
        try:
            pending.handle.wait()
        except Exception as e:  # noqa: BLE001 - the run's own error is the one that propagates
            warnings.warn(f"checkpoint.async_save: {pending.path} was not committed ({e}); the previous checkpoint "
                          f"is intact", AsyncSaveWarning)
            return
        if self.rank == 0:
            self._committed(pending.path, pending.best)

    # -- loading and resuming -----------------------------------------------------------------
    def resolve(self, resume_from: Optional[str]) -> Optional[str]:
        """The directory to resume from (see `resolve_resume`)."""
        return resolve_resume(resume_from, self.save_dir)

    def load(self, trainer, path: str) -> Dict[str, Any]:
        """Load model and optimizer (collective, resharding as nnscaler.ckpt does); returns extra."""
        extra = ckpt_backend().load(path, trainer.model, trainer.optimizer)
        return dict(extra or {})

    def resume(self, trainer) -> Optional[Resumed]:
        """Load the checkpoint ``resume_from`` names into the trainer's model, optimizer, LR
        scheduler and grad scaler; None when it names none (a fresh start). The RNG states come
        back only on the world size that saved them (else a TrainerConfigWarning)."""
        path = self.resolve(self.config.resume_from)
        if path is None:
            return None
        extra = self.load(trainer, path)
        record = extra.get(TRAINER_KEY)
        if isinstance(record, list):  # a merged checkpoint keeps every rank's extra
            record = record[0] if record else None
        state, rng, changed, moved = trainer.state, None, "", ""
        if record:
            state = TrainState.from_dict(record["state"])
            state.idx_in_epoch, moved = _data_position(record["state"], trainer.train_args.resolved_global_batch_size,
                                                       path)
            state.samples_in_epoch = samples_in_epoch(state.idx_in_epoch, trainer.train_args.resolved_global_batch_size)
            if trainer.lr_scheduler is not None and record.get("lr_scheduler") is not None:
                trainer.lr_scheduler.load_state_dict(decode_extra(record["lr_scheduler"]))
                changed = _config_wins(trainer.lr_scheduler, trainer.train_args.lr_scheduler.args)
            if record.get("precision"):
                trainer.precision.load_state_dict(decode_extra(record["precision"]))
            saved = ckpt_backend().inspect(path)
            if saved["world_size"] == trainer.world_size and trainer.rank in saved["rng_ranks"]:
                rng = rng_snapshot(trainer.model)  # nnscaler.ckpt.load restored them; again at train start
            else:
                warnings.warn(f"checkpoint.resume_from: {path} was saved by {record.get('world_size')} processes, "
                              f"this run has {trainer.world_size}: random states start afresh (the run is not "
                              f"bitwise the continuation)", TrainerConfigWarning)
        self.resumed_at(state.step)
        messages = [f"resumed from {path} at epoch {state.epoch}, step {state.step}"]
        if changed:
            messages.append(f"lr_scheduler: {changed} (this run's config; the checkpoint had the former)")
        if moved:
            messages.append(moved)
        return Resumed(path, state, extra, rng, tuple(messages))


def _trainer_record(trainer, val_loss: Optional[float], best: Optional[float]) -> Dict[str, Any]:
    """Counters, data position, LR scheduler and grad scaler, as JSON with tensors (nnscaler.ckpt
    saves each rank's RNG states itself)."""
    state = trainer.state.to_dict()
    state["best_val_loss"], state["last_val_loss"] = best, val_loss
    scheduler = trainer.lr_scheduler
    return {"state": state, "world_size": trainer.world_size,
            "lr_scheduler": encode_extra(scheduler.state_dict()) if scheduler is not None else None,
            "precision": encode_extra(trainer.precision.state_dict())}


def _data_position(saved: Dict[str, Any], global_batch_size: int, path: str) -> Tuple[int, str]:
    """The step within the epoch this run continues from (`data_position`: the samples read
    carry over, whatever the world size and global batch size), and a console line when it is not
    the saved one (the global batch size changed)."""
    idx = saved.get("idx_in_epoch", 0)
    samples = saved.get("samples_in_epoch")
    step = resumed_step_in_epoch(samples, idx, global_batch_size, where=path)
    if step == idx:
        return step, ""
    return step, (f"data position: {samples} samples into epoch {saved.get('epoch', 0)}, step {step} of this run's "
                  f"global batch of {global_batch_size} (the checkpoint's step {idx})")


def _config_wins(scheduler, config_args: Dict[str, Any]) -> str:
    """The scheduler arguments this run's config gives replace the checkpoint's values of the same
    name (``T_max: ${max_train_steps}`` stretches a cosine schedule when a resumed run trains on);
    the counters (``last_epoch``, the current LR) stay the checkpoint's. Returns the changes."""
    state = scheduler.state_dict()
    changed = []
    for name, value in build_args(config_args, "lr_scheduler.args").items():
        if isinstance(value, (int, float, str)) and name in state and hasattr(scheduler, name) and state[name] != value:
            changed.append(f"{name} {state[name]} -> {value}")
            setattr(scheduler, name, value)
    return ", ".join(changed)


def _async_backend(name: str):
    """The checkpoint package, checked to offer `name` (an asynchronous save's function)."""
    backend = ckpt_backend()
    if not hasattr(backend, name):
        raise TrainerError(f"checkpoint.async_save: the installed nnscaler-ckpt has no {name}(); set "
                           f"checkpoint.async_save: false or install a newer nnscaler-ckpt")
    return backend


def _every(every: Optional[int], count: int) -> bool:
    return bool(every) and count % every == 0


def _rank_world() -> Tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        from nnscaler.runtime import failures  # a dead peer: its one-line error, not gloo's traceback
        failures.run(dist.barrier, what="the checkpoint barrier")
