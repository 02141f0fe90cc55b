"""NnScalerStrategy: a Lightning `ParallelStrategy` that trains the LightningModule parallelized
by nnscaler (docs/lightning.md).

Setup (on every rank, inside `Trainer.fit` / `validate` / `test` / `predict`):
1. the process group (gloo on CPU, NCCL on CUDA), as Lightning's DDP does;
2. `configure_optimizers` on the user's module, checked (optimizers.py);
3. `nnscaler.runtime.parallelize(module, dummy_forward_args, ...)`, then the module is converted:
   its forward is the parallel one, `log` reduces over the right group, the traced modules are
   None (model_setup.py; the `Conversion` record is kept here);
4. the optimizer is re-pointed at the parallel parameters (`build_optimizer`).
FSDP-style arguments (`activation_checkpointing_policy`, `cpu_offload`, a model built in
`configure_model`, also on the meta device) are translated by sharded_args.py (`cpu_offload`:
the optimizer steps on fp32 CPU copies, offload.py).
Training then runs Lightning's own loops on the LightningModule itself (no wrapper): gradients
are synchronised inside ``loss.backward()`` (skipped on accumulating steps through
`block_backward_sync`), gradient clipping by norm spans the ranks (precision.py), and
checkpoints go through nnscaler.ckpt (checkpoint.py).
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Callable, Dict, Literal, Optional, Tuple, Union

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from nnscaler.ir import ComputeConfig
from nnscaler.runtime import ReuseType, parallelize, sync_grad_when

from .checkpoint_hooks import CheckpointHooks
from .errors import NnScalerLightningError
from .internals import TrainerScriptLauncher, TrainerSpawnLauncher, sync_ddp_if_available
from .model_setup import Conversion, convert, dummy_forward_args, removed_module_hint
from .optimizers import rebuild, user_optimizer
from .mixed_precision import mixed_precision_config, mixed_precision_setting
from .precision import NnScalerPrecision, adopt_precision_plugin
from .process_layout import ProcessLayout
from .sharded_args import (check_cpu_offload, check_strategy_args, checkpointing_types, built_on_meta, example_rng,
                           offload_device, recompute_config, sharding_config, sharding_strategy_name,
                           wrap_config)

__all__ = ["NnScalerStrategy"]


class NnScalerStrategy(CheckpointHooks, ProcessLayout, ParallelStrategy):
    """Lightning's `ParallelStrategy` arguments, `nnscaler.parallelize`'s, and `state_dict_type`.

    compute_config: a `ComputeConfig`; None: ``ComputeConfig(1, world size)`` (data parallel over
        every device). pas_policy: a policy name or function (default ``"dp"``).
    gen_savedir, reuse, instance_name, broadcast_strategy: as `nnscaler.parallelize`.
    state_dict_type: ``"sharded"`` or ``"deduped"`` (nnscaler.ckpt kinds).
    activation_checkpointing_policy: a set of module types whose ops are recomputed in backward.
    auto_wrap_policy: a set of module types, each such submodule one gather unit under use_zero=3
        (FSDPStrategy's wrap policy; by default each repeated block is one).
    cpu_offload: the optimizer steps on fp32 copies on the CPU (its state lives there), on CUDA
        and on CPU alike (offload.py).
    sharding_strategy: as FSDPStrategy's (a name or torch's ``ShardingStrategy``): FULL_SHARD ->
        ``use_zero=3``, SHARD_GRAD_OP -> ``use_zero=True``, NO_SHARD -> ``use_zero=False``,
        HYBRID_SHARD -> ``use_zero=3`` with ``zero_ngroups`` = the number of nodes (sharded_args.py).
    mixed_precision: as FSDPStrategy's (torch's ``MixedPrecision``, FSDP2's ``MixedPrecisionPolicy`` or a
        mapping): ``use_zero=3``'s ``pas_config["zero3_mixed_precision"]`` (mixed_precision.py).
    process_group_backend, timeout, start_method: as Lightning's `DDPStrategy` (``"popen"`` runs
        the script again per device, ``"spawn"`` / ``"fork"`` start processes from this one).
    """

    strategy_name = "nnscaler"

    def __init__(
        self,
        accelerator=None,
        parallel_devices: Optional[list] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        compute_config: Optional[ComputeConfig] = None,
        pas_policy: Union[str, Callable] = "dp",
        gen_savedir: Union[str, os.PathLike] = "./.nnscaler",
        reuse: Union[ReuseType, str] = ReuseType.MATCH,
        instance_name: Optional[str] = None,
        broadcast_strategy: str = "none",
        state_dict_type: Literal["sharded", "deduped"] = "sharded",
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        activation_checkpointing_policy: Optional[Any] = None,
        cpu_offload: bool = False,
        sharding_strategy: Optional[Any] = None,
        auto_wrap_policy: Optional[Any] = None,
        mixed_precision: Optional[Any] = None,
    ) -> None:
        check_strategy_args(compute_config, state_dict_type, " (merge later with NnScalerStrategy.merge_checkpoint)")
        if checkpoint_io is not None:
            raise NnScalerLightningError("NnScalerStrategy(checkpoint_io=...) is not supported: checkpoints are "
                                         "nnscaler.ckpt directories (state_dict_type); leave checkpoint_io out")
        self._checkpointing_types = checkpointing_types(activation_checkpointing_policy)
        self._wrap_types = checkpointing_types(auto_wrap_policy, "auto_wrap_policy")
        self._sharding = sharding_strategy_name(sharding_strategy)
        self._mixed_precision = mixed_precision_setting(mixed_precision)
        check_cpu_offload(cpu_offload)
        self.cpu_offload = cpu_offload
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, precision_plugin=precision_plugin)
        self.compute_config = compute_config
        self.pas_policy = pas_policy
        self.gen_savedir = gen_savedir
        self.reuse = reuse
        self.instance_name = instance_name
        self.broadcast_strategy = broadcast_strategy
        self.state_dict_type = state_dict_type
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._start_method = start_method
        self._num_nodes = 1
        self._pm = None
        self._conversion: Optional[Conversion] = None

    # -- devices, ranks, processes ---------------------------------------------------------------
    @property
    def is_distributed(self) -> bool:
        """Lightning injects a DistributedSampler (distributed_sampler_kwargs) when this is True."""
        return True

    @property
    def process_group_backend(self) -> Optional[str]:
        return self._process_group_backend

    _LAUNCHERS = (TrainerScriptLauncher, TrainerSpawnLauncher)  # ProcessLayout._configure_launcher

    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        self._init_process_group(**({"device_id": self.root_device} if self.root_device.type != "cpu" else {}))

    # -- precision -------------------------------------------------------------------------------
    @property
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else NnScalerPrecision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        self._precision_plugin = adopt_precision_plugin(plugin, NnScalerPrecision, "NnScalerStrategy", "Trainer")

    # -- setup -----------------------------------------------------------------------------------
    def setup(self, trainer) -> None:
        assert self.accelerator is not None and self.lightning_module is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        fitting = trainer.state.fn == TrainerFn.FITTING
        # configure_optimizers runs on the user's module, before conversion (it may name submodules)
        optimizer, schedulers = user_optimizer(module) if fitting else (None, [])
        self.precision_plugin.set_device(self.root_device.type)
        if self._pm is None:  # a second fit / validate with this strategy keeps the plan in place
            on_meta = built_on_meta(module)  # built in configure_model on meta: each rank fills only its shards
            module = self.precision_plugin.convert_module(module)
            if not on_meta:
                self.model_to_device()
            self._pm, self._conversion = self._parallelize(module, trainer, on_meta)
        if fitting and optimizer is not None:
            self.optimizers = [rebuild(optimizer, self._pm, offload_device(self.cpu_offload))]
            self.lr_scheduler_configs = schedulers
        elif fitting:
            self.optimizers, self.lr_scheduler_configs = [], schedulers
        self.setup_precision_plugin()

    def _parallelize(self, module, trainer, on_meta: bool = False) -> Tuple[Any, Conversion]:
        """This rank's ParallelModule of `module`, and `module` converted around it (model_setup.py)."""
        cfg = self.compute_config or ComputeConfig(1, self.world_size)
        if cfg.runtime_ngpus != self.world_size:
            raise NnScalerLightningError(
                f"NnScalerStrategy(compute_config=ComputeConfig(plan_ngpus={cfg.plan_ngpus}, "
                f"runtime_ngpus={cfg.runtime_ngpus})) but the Trainer runs {self.world_size} process(es) "
                f"(devices x num_nodes): make them equal")
        self.compute_config = cfg = sharding_config(cfg, self._sharding, self.num_nodes)
        cfg = mixed_precision_config(cfg, self._mixed_precision)
        cfg = wrap_config(recompute_config(cfg, self._checkpointing_types, module), self._wrap_types, module)
        with example_rng(on_meta):  # the initialisation on the ranks replays the generator from here
            dummy = self.precision_plugin.convert_input(dummy_forward_args(module, trainer, self))
        was_training = module.training
        module.train()
        try:
            pm = parallelize(module, dummy, self.pas_policy, cfg, gen_savedir=self.gen_savedir, reuse=self.reuse,
                             instance_name=self.instance_name, broadcast_strategy=self.broadcast_strategy)
        finally:
            module.train(was_training)
        pm.train(was_training)
        return pm, convert(module, pm, self.root_device)

    # -- steps: a traced module used outside forward gets a clear error ----------------------------
    def training_step(self, *args: Any, **kwargs: Any):
        with removed_module_hint(self.lightning_module, self._conversion, "training_step"):
            return super().training_step(*args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any):
        with removed_module_hint(self.lightning_module, self._conversion, "validation_step"):
            return super().validation_step(*args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any):
        with removed_module_hint(self.lightning_module, self._conversion, "test_step"):
            return super().test_step(*args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any):
        with removed_module_hint(self.lightning_module, self._conversion, "predict_step"):
            return super().predict_step(*args, **kwargs)

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the parallel module and optimizer must exist to be filled

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint restores it through nnscaler.ckpt

    @contextmanager
    def block_backward_sync(self):
        """Gradient accumulation: backward passes only accumulate locally."""
        with sync_grad_when(False):
            yield None

    # -- collectives -----------------------------------------------------------------------------
    def reduce(self, tensor, group: Optional[Any] = None, reduce_op: Optional[Union[str, Any]] = "mean"):
        if isinstance(tensor, torch.Tensor):
            return sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # -- registry, teardown ----------------------------------------------------------------------
    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        for name, start_method in (("nnscaler", "popen"), ("nnscaler_spawn", "spawn"), ("nnscaler_fork", "fork")):
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=f"nnscaler with start_method '{start_method}'",
                                           start_method=start_method)
