"""The Trainer's set-up and tear-down (`RunSetup`, a base of `Trainer`): the process group and
seeds, the model (built on meta when its weights are read per rank: meta_build.py), parallelized
whole or by sub-modules, the precision, datasets and loaders, the optimizer and LR scheduler,
hooks, checkpoints and loggers; ``run_mode: compile`` (generate the code and stop); and, at the
end, the checkpoint in flight, the loggers and the process group this Trainer created."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
import nnscaler.ckpt as ckpt
from nnscaler.runtime import PrecisionPlugin, RankGrid, has_meta_tensors

from . import setup as build
from .checkpoints import CheckpointManager
from .config.loading import dump_yaml
from .config.values import build_args, instantiate, resolve_object
from .errors import TrainerConfigError, TrainerError
from .hooks import HookChain, TrainHook
from .loggers.console import ConsoleReporter
from .meta_build import MetaBuilt, builds_on_meta, meta_scope
from .moe import MoEMeter, balance_if_asked

__all__ = ["RunSetup"]


class RunSetup:
    """What `Trainer.run` does before the loop and after it (`Trainer` holds the state it sets)."""

    # -- setup ----------------------------------------------------------------------------------
    def _init_env(self) -> None:
        args = self.train_args
        self._owns_group = build.init_distributed(args.compute_config.runtime_ngpus, args.collective_timeout)
        if dist.is_available() and dist.is_initialized():
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        if self.world_size != args.compute_config.runtime_ngpus:
            raise TrainerError(f"compute_config.runtime_ngpus is {args.compute_config.runtime_ngpus} but "
                               f"{self.world_size} processes run; set it to {self.world_size} or start "
                               f"{args.compute_config.runtime_ngpus}")
        if args.seed is not None:
            build.seed_everything(args.seed)
        if args.init_env_fn is not None:
            resolve_object(args.init_env_fn, "init_env_fn")(self)

    def _build_model(self) -> torch.nn.Module:
        args = self.train_args
        kind = resolve_object(args.model.type, "model.type")
        with meta_scope(builds_on_meta(kind, args)):  # filled after parallelize (trainer/meta_build.py)
            model = instantiate(kind, build_args(args.model.args, "model.args"), "model.args")
        if args.tracing_from_weights and not args.uses_parallel_modules:
            build.load_tracing_weights(model, args.tracing_from_weights)
        return model

    def _compile(self) -> None:
        """Generate the code (rank 0, or the only process) and stop."""
        args = self.train_args
        if "RANK" in os.environ:
            self._init_env()
        elif args.seed is not None:
            build.seed_everything(args.seed)
        model = self._build_model()
        if args.uses_parallel_modules:
            build.parallelize_submodules(args, model, load_module=False)
        else:
            dataset = build.build_dataset(args.dataset, "train")
            build.parallelize_model(args, model, build.dummy_batch(args, dataset), load_module=False)

    def _setup(self) -> None:
        args = self.train_args
        self._init_env()
        self.precision = PrecisionPlugin(args.precision)
        self.train_dataset = build.build_dataset(args.dataset, "train")
        self.val_dataset = build.build_dataset(args.dataset, "val")
        original = self._build_model()
        self.original_model = original
        if args.uses_parallel_modules:  # the plain part in the trainer's precision, each sub-module in its own
            original = self.precision.setup_module(original)
            build.parallelize_submodules(args, original, load_module=True)
            self.model = original
        else:
            weights = original.weights_to_load if isinstance(original, MetaBuilt) else None
            replay = weights is None and has_meta_tensors(original)  # initialized on the ranks from the seed
            with torch.random.fork_rng(devices=[], enabled=replay):  # the dummy loader draws a seed: not before the init
                dummy = build.dummy_batch(args, self.train_dataset)
            self.model = build.parallelize_model(args, original, dummy, True, init_module_params=weights is None)
            if replay:  # the generator where the CPU build leaves it: past the init, then the dummy loader's draw
                build.dummy_batch(args, self.train_dataset)
            if weights is not None:  # built on meta: each rank reads only the regions it holds
                ckpt.load(weights, self.model)
            self.model = self.precision.setup_module(self.model)
        self.model.train()
        if self.val_dataset is not None:
            _check_eval_mode_runs(self.model)  # before the first step, not at the first validation
        self._moe = MoEMeter.for_run(args, original)
        balance_if_asked(original, self.model)  # DeepSeek-V3's router biases, moved after each step
        self.optimizer = build.build_trainer_optimizer(args, self.model, self.precision)
        self.lr_scheduler = build.build_lr_scheduler(args, self.optimizer)
        if args.optimizer.aggregate_outputs_fn:
            self.aggregate_outputs_fn = resolve_object(args.optimizer.aggregate_outputs_fn, "optimizer.aggregate_outputs_fn")
        self._generator = torch.Generator()
        self.train_loader, self.train_sampler = build.build_dataloader(args, self.train_dataset, "train", self.rank,
                                                                       self._generator)
        if self.val_dataset is not None:
            self.val_loader, self.val_sampler = build.build_dataloader(args, self.val_dataset, "val", self.rank,
                                                                       torch.Generator())
        members = [m for m in (original, self.optimizer, self.lr_scheduler) if isinstance(m, TrainHook)]
        members += build.build_config_hooks(self.train_args)
        self.hooks = HookChain(members)
        self.checkpoints = CheckpointManager(args.checkpoint, config_yaml=dump_yaml(args.to_dict()))
        self.checkpoints.prepare(self.model, self.optimizer)  # checkpoint.async_save: the writer starts now
        self._setup_loggers()

    def _setup_loggers(self) -> None:
        args = self.train_args
        self.steps_per_epoch = len(self.train_loader) // args.update_freq
        total = args.max_train_steps
        if args.max_epochs is not None:
            by_epochs = args.max_epochs * self.steps_per_epoch
            total = by_epochs if total is None else min(total, by_epochs)
        self.total_steps = total
        self.console = ConsoleReporter(self.rank == 0, args.enable_progress_bar, total)
        if self.rank == 0:
            self.loggers = build.build_loggers(args)

    def _teardown(self, ok: bool) -> None:
        """Finish the checkpoint in flight (async_save; on failure without collectives), close
        loggers; destroy the process group if this Trainer created it (after a barrier when the
        run succeeded, so no rank leaves while a peer still talks to it)."""
        checkpoints = getattr(self, "checkpoints", None)
        if checkpoints is not None:
            checkpoints.close(failed=not ok)
        console = getattr(self, "console", None)
        if console is not None:
            console.close()
        for logger in self.loggers:
            logger.finalize()
        self.loggers = []
        if self._owns_group and dist.is_initialized():
            if ok:
                dist.barrier()
            RankGrid.destroy_all()
            dist.destroy_process_group()
            self._owns_group = False


def _check_eval_mode_runs(model: torch.nn.Module) -> None:
    """A run that validates: refuse, before any step, a ParallelModule whose generated code (traced in
    training mode) cannot run in eval mode (ParallelModule.check_mode), so that a first validation
    failing that way never loses the training done before it."""
    from nnscaler.runtime import ParallelModule
    for pm in [m for m in model.modules() if isinstance(m, ParallelModule)]:
        if pm.MODE_DIVERGENCE is not None and pm.TRACED_TRAINING:
            raise TrainerConfigError(
                "dataset.val_args", f"the run validates, but {type(pm).__name__}'s forward was traced in training "
                f"mode and runs other ops in eval mode, at {pm.MODE_DIVERGENCE}: its generated code follows the "
                f"training mode only, so the first validation would fail after the training before it. Make the "
                f"difference an argument of an op (e.g. F.dropout(x, p, training=self.training), torch.where) "
                f"instead of a Python branch on self.training (for transformers' router_jitter_noise: set it to 0), "
                f"or train without validation (remove dataset.val_args)")
