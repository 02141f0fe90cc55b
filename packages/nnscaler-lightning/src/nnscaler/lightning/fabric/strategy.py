"""nnscaler.lightning.fabric.NnScalerStrategy: nnscaler for Lightning Fabric's own loops.

`fabric.setup(model, optimizer)` parallelizes `model` (tracing input: the model's
`dummy_forward_args`, else the strategy's `dummy_forward_args`) and re-points the optimizer (same
object, class and hyper-parameters) at the parallel parameters; the module Fabric returns wraps
this rank's ParallelModule, whose outputs are whole on every rank. Gradients are averaged inside
`fabric.backward`; `fabric.no_backward_sync(model)` skips that while accumulating;
`fabric.clip_gradients(model, opt, max_norm=...)` clips by the global norm; `fabric.save` /
`fabric.load` go through nnscaler.ckpt (a directory; modules and optimizers as tensors, the rest
of the state and the precision's grad-scaler state as JSON with tensors). Precision: `Fabric(
precision=...)` of a supported kind becomes `NnScalerPrecision` (fabric/precision.py).

A model built on the meta device (``fabric.init_module(empty_init=True)``, or ``torch.device("meta")``)
is never materialized whole: `parallelize` gives each rank only its local tensors (under
``use_zero=3`` its shards), filled from the model's own initialisation (the values of building it
on the CPU with the same seed, runtime/driver/meta_init.py); ``fabric.load_raw(path, model)``
then fills them from an nnscaler checkpoint or a Hugging Face directory (nnscaler.ckpt.load: each
rank reads only what it holds).
"""
from __future__ import annotations

import os
from contextlib import ExitStack, nullcontext
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies.parallel import ParallelStrategy
from nnscaler.ir import ComputeConfig
from nnscaler.runtime import ParallelModule, ReuseType, parallelize, sync_grad_when

from .. import checkpoint as ckpt_io
from ..process_layout import ProcessLayout
from ..errors import NnScalerLightningError
from ..internals import BackwardSyncControl, FabricScriptLauncher, FabricSpawnLauncher, sync_ddp_if_available
from ..optimizers import check_optimizer, rebuild
from ..precision import adopt_precision_plugin
from ..mixed_precision import mixed_precision_config, mixed_precision_setting
from ..sharded_args import (check_cpu_offload, check_strategy_args, checkpointing_types, built_on_meta, example_rng,
                            offload_device, recompute_config, sharding_config, sharding_strategy_name,
                            wrap_config)
from ..state_codec import decode, encode
from .precision import NnScalerPrecision

__all__ = ["NnScalerStrategy"]


class _NoSync(BackwardSyncControl):
    def no_backward_sync(self, module, enabled: bool):
        return sync_grad_when(False) if enabled else nullcontext()


class NnScalerStrategy(ProcessLayout, ParallelStrategy):
    """Fabric's `ParallelStrategy` arguments, `nnscaler.parallelize`'s, `state_dict_type`, and
    `dummy_forward_args` (used when the model has no such attribute); `sharding_strategy` as the
    Trainer strategy's (FSDP's names -> use_zero), `mixed_precision` too. See docs/lightning.md."""

    def __init__(self, accelerator=None, parallel_devices: Optional[list] = None, cluster_environment=None,
                 precision=None, compute_config: Optional[ComputeConfig] = None,
                 pas_policy: Union[str, Callable] = "dp", gen_savedir: Union[str, os.PathLike] = "./.nnscaler",
                 reuse: Union[ReuseType, str] = ReuseType.MATCH, instance_name: Optional[str] = None,
                 broadcast_strategy: str = "none", state_dict_type: str = "sharded",
                 dummy_forward_args: Optional[Dict[str, Any]] = None, process_group_backend: Optional[str] = None,
                 timeout: Optional[timedelta] = default_pg_timeout, start_method: str = "popen",
                 activation_checkpointing_policy: Optional[Any] = None, cpu_offload: bool = False,
                 sharding_strategy: Optional[Any] = None, auto_wrap_policy: Optional[Any] = None,
                 mixed_precision: Optional[Any] = None) -> None:
        check_strategy_args(compute_config, state_dict_type)
        self._checkpointing_types = checkpointing_types(activation_checkpointing_policy)
        self._wrap_types = checkpointing_types(auto_wrap_policy, "auto_wrap_policy")
        self._sharding = sharding_strategy_name(sharding_strategy)
        self._mixed_precision = mixed_precision_setting(mixed_precision)  # ../mixed_precision.py
        check_cpu_offload(cpu_offload)
        self.cpu_offload = cpu_offload
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, precision=precision)
        self.compute_config, self.pas_policy, self.gen_savedir = compute_config, pas_policy, gen_savedir
        self.reuse, self.instance_name, self.broadcast_strategy = reuse, instance_name, broadcast_strategy
        self.state_dict_type, self.dummy_forward_args = state_dict_type, dummy_forward_args
        self._process_group_backend, self._timeout, self._start_method = process_group_backend, timeout, start_method
        self._num_nodes = 1
        self._backward_sync_control = _NoSync()

    @property
    def precision(self) -> NnScalerPrecision:
        return self._precision if self._precision is not None else NnScalerPrecision()

    @precision.setter
    def precision(self, plugin) -> None:
        self._precision = adopt_precision_plugin(plugin, NnScalerPrecision, "the nnscaler Fabric strategy", "Fabric")

    _LAUNCHERS = (FabricScriptLauncher, FabricSpawnLauncher)  # ProcessLayout._configure_launcher

    def setup_environment(self) -> None:
        super().setup_environment()
        self.set_world_ranks()
        self._init_process_group()

    # -- model and optimizer ---------------------------------------------------------------------
    def _parallelize(self, module: torch.nn.Module) -> ParallelModule:
        cfg = self.compute_config or ComputeConfig(1, self.world_size)
        if cfg.runtime_ngpus != self.world_size:
            raise NnScalerLightningError(
                f"NnScalerStrategy(compute_config=ComputeConfig(plan_ngpus={cfg.plan_ngpus}, runtime_ngpus="
                f"{cfg.runtime_ngpus})) but Fabric runs {self.world_size} process(es): make them equal")
        self.precision.set_device(self.root_device.type)
        self.compute_config = cfg = sharding_config(cfg, self._sharding, self.num_nodes)
        cfg = mixed_precision_config(cfg, self._mixed_precision)
        on_meta = built_on_meta(module)  # each rank fills only its shards (sharded_args.built_on_meta)
        cfg = wrap_config(recompute_config(cfg, self._checkpointing_types, module), self._wrap_types, module)
        with example_rng(on_meta):
            dummy = getattr(module, "dummy_forward_args", None) or self.dummy_forward_args
        if not isinstance(dummy, dict):
            raise NnScalerLightningError(
                f"NnScalerStrategy traces {type(module).__name__}.forward and needs an example input: give the model "
                f"a `dummy_forward_args` dict, or NnScalerStrategy(dummy_forward_args={{name: tensor}}), shaped like "
                f"one rank's batch (got {type(dummy).__name__})")
        was_training = module.training
        module.train()
        try:
            pm = parallelize(module, self.precision.trace_input(dummy), self.pas_policy, cfg,
                             gen_savedir=self.gen_savedir, reuse=self.reuse, instance_name=self.instance_name,
                             broadcast_strategy=self.broadcast_strategy)
        finally:
            module.train(was_training)
        pm.train(was_training)
        return pm

    def setup_module_and_optimizers(self, module, optimizers: List[torch.optim.Optimizer], scheduler=None):
        if len(optimizers) != 1:
            raise NnScalerLightningError(f"fabric.setup(model, *optimizers) got {len(optimizers)} optimizers; "
                                         f"NnScalerStrategy supports one optimizer: put every parameter in one")
        check_optimizer(optimizers[0], module, "fabric.setup got")
        pm = self._parallelize(module)
        return pm, [rebuild(optimizers[0], pm, offload_device(self.cpu_offload))], scheduler

    def setup_module(self, module):
        return self._parallelize(module)

    def setup_optimizer(self, optimizer):
        raise NnScalerLightningError("NnScalerStrategy sets up the model and its optimizer together: call "
                                     "fabric.setup(model, optimizer) instead of fabric.setup_optimizers")

    def module_init_context(self, empty_init: Optional[bool] = None):
        """``fabric.init_module(empty_init=True)`` builds the model on the meta device (each rank then
        allocates only what it holds, at `fabric.setup`); otherwise on the root device."""
        if not empty_init:
            return super().module_init_context(empty_init)
        stack = ExitStack()
        stack.enter_context(torch.device("meta"))
        stack.enter_context(self.precision.module_init_context())
        return stack

    def module_to_device(self, module) -> None:
        if not built_on_meta(module):  # a meta-built model: parallelize allocates each rank's part
            module.to(self.root_device)

    def clip_gradients_norm(self, module, optimizer, max_norm, norm_type=2.0, error_if_nonfinite=True):
        if float(norm_type) != 2.0:
            raise NnScalerLightningError(f"fabric.clip_gradients(norm_type={norm_type}): NnScalerStrategy clips by "
                                         f"the L2 norm only; use norm_type=2")
        optimizer = getattr(optimizer, "optimizer", optimizer)  # Fabric's wrapper
        self.precision.unscale_gradients(optimizer)
        norm = optimizer.clip_gnorm(float(max_norm))
        if error_if_nonfinite and not torch.isfinite(norm):
            raise RuntimeError(f"The total norm of gradients is {norm.item()}: non-finite")
        return norm

    # -- collectives -----------------------------------------------------------------------------
    def all_reduce(self, tensor, group=None, reduce_op="mean"):
        return sync_ddp_if_available(tensor, group, reduce_op=reduce_op) if isinstance(tensor, torch.Tensor) \
            else tensor

    # -- checkpoints -----------------------------------------------------------------------------
    def save_checkpoint(self, path, state: Dict[str, Any], storage_options=None, filter=None) -> None:
        if storage_options is not None or filter is not None:
            raise NnScalerLightningError("fabric.save(..., storage_options / filter) is not supported by "
                                         "NnScalerStrategy: leave them out")
        pm, opt, rest = self._split(state)
        import nnscaler.ckpt as ckpt
        path = self.broadcast(os.fspath(path))
        ckpt.save(path, pm, opt, kind=self.state_dict_type, overwrite=True,
                  extra={"fabric": encode(rest), "keys": {"model": self._key, "optimizer": self._opt_key},
                         "precision": encode(self.precision.state_dict())})

    def load_checkpoint(self, path, state=None, strict: bool = True, weights_only=None) -> Dict[str, Any]:
        import nnscaler.ckpt as ckpt
        if isinstance(state, (torch.nn.Module, torch.optim.Optimizer)):  # fabric.load_raw(path, obj)
            return self._load_raw(path, state, strict)
        if isinstance(path, (str, os.PathLike)) and ckpt.is_hf_directory(path):
            raise NnScalerLightningError(f"fabric.load({os.fspath(path)!r}, state): a Hugging Face model directory "
                                         f"holds only the model's weights: call fabric.load_raw(path, model)")
        if not isinstance(state, dict) or not state:
            raise NnScalerLightningError("fabric.load(path, state) with NnScalerStrategy needs the state dict "
                                         "holding the set-up model (and optimizer) to fill in place")
        pm, opt, rest = self._split(state)
        path = self.broadcast(os.fspath(path))
        ckpt_io.checkpoint_dir(path)
        extra = ckpt.load(path, pm, opt)
        saved = decode(extra.get("fabric", {}))
        self.precision.load_state_dict(decode(extra.get("precision", {})))
        for key in list(rest):
            if key in saved:
                state[key] = saved.pop(key)
            elif strict:
                raise NnScalerLightningError(f"fabric.load: '{key}' is not in checkpoint {path} (strict=True)")
        return saved

    def _load_raw(self, path, obj, strict: bool) -> Dict[str, Any]:
        """``fabric.load_raw(path, model)``: the model's weights (any plan) from an nnscaler
        checkpoint or a Hugging Face directory, each rank reading only what it holds."""
        import nnscaler.ckpt as ckpt
        if not isinstance(obj, torch.nn.Module):
            raise NnScalerLightningError(f"fabric.load_raw(path, {type(obj).__name__}) with NnScalerStrategy: an "
                                         f"optimizer's state is loaded with its model, by fabric.load(path, "
                                         f"{{'model': model, 'optimizer': optimizer}})")
        if not strict:
            raise NnScalerLightningError("fabric.load_raw(path, model, strict=False) with NnScalerStrategy: the "
                                         "checkpoint must hold every tensor of the model; leave strict=True")
        ckpt.load(self.broadcast(os.fspath(path)), obj)
        return {}

    def _split(self, state: Dict[str, Any]) -> Tuple[ParallelModule, Any, Dict[str, Any]]:
        pm, opt, rest, self._key, self._opt_key = None, None, {}, None, None
        for key, value in state.items():
            inner = getattr(value, "_forward_module", value)
            if isinstance(inner, ParallelModule):
                pm, self._key = inner, key
            elif isinstance(getattr(value, "optimizer", value), torch.optim.Optimizer):
                opt, self._opt_key = getattr(value, "optimizer", value), key
            else:
                rest[key] = value
        if pm is None:
            raise NnScalerLightningError("fabric.save / load with NnScalerStrategy: the state holds no model set up by "
                                         "fabric.setup; put it in the state (e.g. {'model': model, ...})")
        return pm, opt, rest

    @classmethod
    def merge_checkpoint(cls, checkpoint_files, output_file) -> None:
        """As `nnscaler.lightning.NnScalerStrategy.merge_checkpoint`."""
        ckpt_io.merge(checkpoint_files, output_file)

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        if "nnscaler" not in strategy_registry:
            strategy_registry.register("nnscaler", cls, description="nnscaler", start_method="popen")
