"""ParallelModule: the base class of the generated per-rank modules.

Contract for generated code (one module file per runtime rank, `gencode{rank}.py`; the class
attributes are listed, with their meaning and defaults, in nnscaler.ir.contracts.GENERATED_ATTRS)::

    class GenModel(nnscaler.runtime.ParallelModule):
        COMPUTE_CONFIG = {...}   # ComputeConfig.to_dict(); a ComputeConfig once the class exists
        RANK = 0                 # plan device this file was generated for (checked modulo plan_ngpus)
        SOURCE_MAP = {57: "model.py:42 in MLP.forward (layers.0): x = F.gelu(layer(x))"}
        RANDOM = {"mode": "parallel", "ops": 9}  # optional: the program's random ops (runtime/random.py)

        def __init__(self, init_params=True):
            super().__init__()
            self.register_parameter('layers_0_weight', torch.nn.Parameter(torch.empty(16, 16)))
            self.add_full_map('layers_0_weight', 'layers.0.weight', full_shape=(16, 16),
                              slices=((0, 16), (0, 16)), value_split=(0, 1))
            self._post_init(init_params)

        def _forward_impl(self, x, y):
            ...

Conventions:
- `slices[i] = (start, stop)` along dim i of the full tensor; the local tensor has exactly that
  shape. `value_split = (i, n)`: the local tensor is piece i of n partial values whose SUM is the
  full value. Loading full weights puts the whole value in piece 0 and zeros in pieces 1..n-1
  (exact, no rounding); merging sums the pieces. `(0, 1)` means not value-split.
- `replicas` (default 1): how many plan devices of a unit hold an identical copy of this local
  tensor (tensor-parallel replication); gradient-norm clipping counts such a tensor once.
- A tied parameter has one local name and one `add_full_map`; every other full name it answers
  to is declared with `add_full_alias(full_name, local_name)`.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, List, Mapping, Optional, Sequence

import torch

from nnscaler.ir import as_compute_config
from nnscaler.ir.contracts import FullMapEntry, GeneratedAttrs, gencode_file, reshard_sizes, root_modules, smaller_sizes
from nnscaler.ir.contracts import kept_after_forward, unit_names
from nnscaler.ir.contracts import WEIGHTS_FILE
from nnscaler.ir.contracts import mixed_precision
from nnscaler.ir import map_tensors

from . import failures
from .failures import watch_backward
from .call_arguments import call_error
from .device import default_device
from .errors import GenerationError, NnScalerError, PlanMismatchError
from .full_map import FullMapMixin
from .gradients import scaled_loss
from .grid import RankGrid
from .pipeline_grads import PipelineGradSync, zero3_cross_groups
from .random import RandomStreamsMixin
from .reducer import Reducer
from .source_notes import note_source
from .weight_loading import WeightLoadingMixin
from .zero3 import FullyShardedParams
from .zero3_held import held_tensors
from .zero3_reshard import SmallerReshard, make_smaller_groups
from .zero_groups import make_zero_groups

__all__ = ["ParallelModule", "FullMapEntry", "INIT_WEIGHTS_FILE", "make_compute_config"]

INIT_WEIGHTS_FILE = WEIGHTS_FILE


make_compute_config = as_compute_config  # the generated COMPUTE_CONFIG -> ComputeConfig (kept for callers)


def _real_default_device():
    """The CPU as the default device while the runtime itself runs (process groups, random streams,
    placement) when the generated class is built under ``torch.device("meta")``, which only the
    generated registrations should see (a meta-built model: runtime/driver/meta_init.py)."""
    return torch.device("cpu") if torch.get_default_device().type == "meta" else contextlib.nullcontext()


class ParallelModule(GeneratedAttrs, FullMapMixin, WeightLoadingMixin, RandomStreamsMixin, torch.nn.Module):
    """One rank's share of a parallelized model. See the module docstring for the contract.

    The class attributes generated code sets (COMPUTE_CONFIG, RANK, GRAPH_FINGERPRINT,
    TRACED_TRAINING, RANDOM, MODE_DIVERGENCE, PIPELINE, SOURCE_MAP) and their defaults are declared
    by `GeneratedAttrs` from nnscaler.ir.contracts.GENERATED_ATTRS; PIPELINE is a `PipelineMeta`."""

    def __init__(self):
        with _real_default_device():
            self._setup_parallel()

    def _setup_parallel(self) -> None:
        super().__init__()
        self.training = bool(self.TRACED_TRAINING)
        self.compute_config = make_compute_config(self.COMPUTE_CONFIG)
        self.grid = RankGrid.get(self.compute_config.plan_ngpus, self.compute_config.runtime_ngpus)
        failures.arm()  # lets peers tell that this process died (failures/)
        self.rank = self.grid.rank
        self.device = default_device()
        self.reducer: Optional[Reducer] = None  # the data-parallel gradient sync
        self.pipeline_grads: Optional[PipelineGradSync] = None  # a pipelined module's end-of-step sync
        self.fully_sharded: Optional[FullyShardedParams] = None  # use_zero=3 (runtime/zero3.py)
        self._pipeline_executor = None
        self._init_full_map()
        if self.RANK is not None and self.RANK % self.grid.plan_ngpus != self.grid.plan_device:
            raise PlanMismatchError(
                f"{type(self).__name__} was generated for plan device {self.RANK % self.grid.plan_ngpus} "
                f"but rank {self.rank} runs plan device {self.grid.plan_device} "
                f"(= rank % plan_ngpus): load {gencode_file(self.grid.plan_device)}.")

    # -- initialisation -------------------------------------------------------------------------
    def _post_init(self, init_params: bool = True) -> None:
        """End of the generated __init__: device placement, initial weights, gradient reducers."""
        with _real_default_device():
            self._place_and_prepare(init_params)

    def _place_and_prepare(self, init_params: bool) -> None:
        unmapped = self.unmapped_tensors()
        if unmapped:
            raise GenerationError(f"{type(self).__name__} registers {', '.join(unmapped)} without add_full_map: "
                                  f"regenerate the code (ReuseType.OVERRIDE)")
        cfg = self.compute_config
        on_meta = any(t.is_meta for t in (*self.parameters(), *self.buffers()))
        # built under torch.device("meta") (parallelize of a meta-built model): under use_zero=3 each
        # rank allocates only its shards (FullyShardedParams.shard), the buffers whole
        shard_now = on_meta and cfg.zero_stage == 3 and not cfg.inference_only
        if shard_now:
            for m in self.modules():
                for k, b in m._buffers.items():
                    if b is not None and b.is_meta:
                        m._buffers[k] = torch.empty_like(b, device=self.device)
        elif on_meta:
            self.to_empty(device=self.device)
        else:
            self.to(self.device)
        if init_params:
            self.load_initial_weights()
        self._random_streams  # collective: rank 0's seed (runtime/random.py)
        cfg = self.compute_config
        training = not cfg.inference_only
        trainable = self.parameters_for_optimizer()
        if self.PIPELINE is not None:
            self.pipeline_grads = PipelineGradSync(self, training, cfg.reducer_bucket_cap_mb)
            shared = self.pipeline_grads.shared_parameters()
            trainable = [p for p in trainable if id(p) not in shared]
        if cfg.zero_stage == 3 and training:
            self.fully_sharded = self._fully_sharded_params()
            if shard_now:
                self.fully_sharded.shard(self.device)
        elif self.grid.dp_size > 1 and trainable and training:
            self.reducer = Reducer(trainable, group=self.grid.sync_group, bucket_cap_mb=cfg.reducer_bucket_cap_mb,
                                   async_op=cfg.use_async_reducer)

    def _fully_sharded_params(self) -> FullyShardedParams:
        shared = zero3_cross_groups(self)  # tensors several pipeline stages hold (collective: creates groups)
        cfg = self.compute_config
        params = [(local, self.fullmap[local].full_name, p) for local, p in self.named_parameters()]
        # codegen resolves pas_config['zero3_units'] (classes, globs) into SHARD_UNITS; a module written
        # by hand may give module paths in pas_config
        units = self.SHARD_UNITS if self.SHARD_UNITS is not None else cfg.pas_config.get("zero3_units", ())
        if isinstance(units, str):
            units = [u.strip() for u in units.split(",") if u.strip()]
        # the embeddings and the head outside the blocks are units of their own (a small root); tied ones stay
        full = [f for _, f, _ in params]
        shapes = {self.fullmap[local].full_name: tuple(self.fullmap[local].full_shape) for local, _, _ in params}
        tied = {n for alias, local in self.full_aliases.items() for n in (alias, self.fullmap[local].full_name)}
        edges = root_modules(full, shapes, units, tied)
        groups = make_zero_groups(self.grid, cfg.zero_ngroups)
        keep, smaller = self._resharded_after_forward(set(unit_names(full, [*units, *edges]).values()), groups.size)
        sharded = FullyShardedParams(params, groups, [*units, *edges], shared,
                                     edges=edges, keep=keep, smaller=smaller)
        # FSDP2's MixedPrecisionPolicy: the dtypes each unit is gathered and reduced in (the code was traced in them)
        sharded.set_precision(mixed_precision(cfg.pas_config.get("zero3_mixed_precision"), cfg.zero_stage),
                              pipelined=self.PIPELINE is not None)
        return sharded

    def _resharded_after_forward(self, units, group_size: int):
        """FSDP2's ``reshard_after_forward`` (``pas_config["zero3_reshard_after_forward"]``): the units kept
        gathered after forward, and the units resharded to a smaller group (COLLECTIVE: makes the smaller
        groups of every size the setting names, on every rank)."""
        cfg = self.compute_config
        setting = cfg.pas_config.get("zero3_reshard_after_forward", True)
        sizes = reshard_sizes(units, setting, group_size)
        groups = make_smaller_groups(self.grid, cfg.zero_ngroups, smaller_sizes(setting, group_size))
        smaller = SmallerReshard({u: k for u, k in sizes.items() if 1 < k < group_size}, groups)
        return kept_after_forward(units, setting, group_size), smaller

    def __getattr__(self, name: str):
        value = super().__getattr__(name)
        sharded = self.__dict__.get("fully_sharded")
        if sharded is not None and sharded.redirects(name):
            return sharded.get(name)
        return value

    def _apply(self, fn, *args, **kwargs):
        out = super()._apply(fn, *args, **kwargs)
        if self.__dict__.get("fully_sharded") is not None:  # .to(dtype), .cuda(): the shards too
            self.fully_sharded.apply(fn)
        return out

    def unsharded(self, writeback: bool = False):
        """Every parameter holds its whole local value inside (see `GeneratedAttrs.unsharded`):
        under use_zero=3 the units are all-gathered (COLLECTIVE) and, with `writeback`, stored back
        into the shards on exit; a no-op otherwise."""
        if self.fully_sharded is None:
            return contextlib.nullcontext()
        return self.fully_sharded.unsharded(writeback)

    def held_tensors(self):
        """The sharded parameters' parts this rank holds (see `GeneratedAttrs.held_tensors`); None
        when every parameter is whole (not use_zero=3, not yet sharded, inside `unsharded`)."""
        return None if self.fully_sharded is None else held_tensors(self.fully_sharded)

    def load_full_state(self, tensors, strict: bool = True) -> None:
        with self.unsharded(writeback=True):
            super().load_full_state(tensors, strict)

    # -- running --------------------------------------------------------------------------------
    def to_device(self, obj: Any) -> Any:
        """`obj` (nested containers) with every tensor on this rank's device."""
        return map_tensors(obj, lambda t: t if t.device == self.device else t.to(self.device))

    def forward(self, *args, **kwargs):
        if self.PIPELINE is not None:
            raise NnScalerError(f"{type(self).__name__} is pipelined (pipeline_scheduler "
                                f"{self.PIPELINE.scheduler!r}): its stages run only inside train_step(samples) "
                                f"/ infer_step(samples), not through a plain forward call")
        failures.check_step(f"{type(self).__name__}.forward")  # refused after a failed step (failures/)
        self.check_mode()
        args, kwargs = self.to_device((args, kwargs))
        try:
            with self.rng_scope(), self._sharded_scope():  # random stream (random.py), zero3.py
                out = self._forward_impl(*args, **kwargs)
        except Exception as exc:
            bad_call = call_error(self, exc, args, kwargs)  # arguments that do not fit forward's signature
            note_source(self, bad_call or exc)
            failures.report(bad_call or exc, "forward")  # peers waiting in a collective raise with it
            if bad_call is not None:
                raise bad_call from None
            raise
        watch_backward(out)  # a backward pass through `out` that raises is reported too (failures/backward.py)
        return out

    def _sharded_scope(self):
        return self.fully_sharded.forward_scope() if self.fully_sharded is not None else contextlib.nullcontext()

    def check_mode(self) -> None:
        """Refuse the mode the generated code cannot follow (see MODE_DIVERGENCE)."""
        if self.MODE_DIVERGENCE is None or self.training == self.TRACED_TRAINING:
            return
        traced, now = ("training", "eval") if self.TRACED_TRAINING else ("eval", "training")
        raise NnScalerError(
            f"{type(self).__name__} is in {now} mode, but its forward was traced in {traced} mode and runs other "
            f"ops in {now} mode, at {self.MODE_DIVERGENCE}. The generated code follows the {traced} mode only: call "
            f".{'train' if self.TRACED_TRAINING else 'eval'}() to go back, or make the difference an argument of an "
            f"op (e.g. F.dropout(x, p, training=self.training), torch.where) instead of a Python branch on "
            f"self.training, then generate again; or parallelize a copy of the model in {now} mode for it")

    def _forward_impl(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} must define _forward_impl (generated code)")

    def note_source(self, exc: BaseException) -> None:
        """Add a note to `exc` naming the user's line of the deepest generated frame."""
        note_source(self, exc)

    def no_sync(self):
        """Context manager: backward passes inside only accumulate this module's gradients locally
        (DDP's ``model.no_sync()``; for a pipelined module `train_step` leaves them
        unsynchronised); other modules keep synchronising. The next synchronising backward (or
        `train_step`) averages the accumulated sum."""
        return self.sync_grad_when(False)

    def sync_grad_when(self, cond: bool):
        """Inside `sync_grad_when(False)`, backward only accumulates this module's gradients
        (for a pipelined module: `train_step` leaves them unsynchronised)."""
        if self.pipeline_grads is not None:
            return self.pipeline_grads.pause(cond)
        if self.fully_sharded is not None:
            return self.fully_sharded.sync_grad_when(cond)
        return self.reducer.sync_grad_when(cond) if self.reducer is not None else contextlib.nullcontext()

    def parameters_for_optimizer(self) -> List[torch.nn.Parameter]:
        """This rank's trainable parameters."""
        return [p for p in self.parameters() if p.requires_grad]

    # -- end2end --------------------------------------------------------------------------------
    def _check_end2end(self, what: str, training: bool) -> None:
        cfg = self.compute_config
        if training and cfg.inference_only:
            raise NnScalerError(f"{type(self).__name__}.{what}: the module was generated with "
                                f"inference_only=True; use infer_step, or regenerate with inference_only=False")
        if not cfg.use_end2end:
            raise NnScalerError(f"{type(self).__name__}.{what} needs ComputeConfig(use_end2end=True): "
                                f"regenerate with it, or call the module and loss.backward() yourself")

    def train_step(self, samples: Sequence[Any],
                   scale_fn: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> List[Any]:
        """Forward and backward every micro-batch; gradients accumulate locally and are synced
        once, in the last backward. A sample is a dict (keyword arguments), a tuple (positional
        arguments) or any other object (the single first argument). The first output of forward
        is the loss. Returns the outputs, detached (the losses unscaled).

        `scale_fn(loss)` is what backward runs on instead of each micro-batch's loss, e.g. a
        grad scaler's `scaler.scale` for fp16 loss scaling, or `lambda l: l / n`. Without it the
        gradients are the sum over the micro-batches (see optimizer.scale_grads)."""
        self._check_end2end("train_step", training=True)
        if scale_fn is not None and not callable(scale_fn):
            raise NnScalerError(f"{type(self).__name__}.train_step: scale_fn must be a callable taking the loss "
                                f"tensor and returning the tensor to run backward on, got {type(scale_fn).__name__}")
        if self.PIPELINE is not None:
            return self._executor().run(samples, training=True, scale_fn=scale_fn)
        outputs = []
        for i, sample in enumerate(samples):
            with self.sync_grad_when(i == len(samples) - 1):
                out = self._call_sample(sample)
                loss = out[0] if isinstance(out, (tuple, list)) else out
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                    raise NnScalerError(f"{type(self).__name__}.train_step: the first output of forward must be "
                                        f"the scalar loss, got {type(loss).__name__}")
                scaled_loss(loss, scale_fn, type(self).__name__).backward()
            outputs.append(map_tensors(out, torch.Tensor.detach))
        return outputs

    def infer_step(self, samples: Sequence[Any]) -> List[Any]:
        """Forward every micro-batch without gradients; returns the outputs."""
        self._check_end2end("infer_step", training=False)
        if self.PIPELINE is not None:
            return self._executor().run(samples, training=False)
        with torch.no_grad():
            return [self._call_sample(sample) for sample in samples]

    def _executor(self):
        if self._pipeline_executor is None:
            from .pipeline.executor import PipelineExecutor
            self._pipeline_executor = PipelineExecutor(self)
        return self._pipeline_executor

    def _call_sample(self, sample: Any):
        if isinstance(sample, Mapping):
            return self(**sample)
        if isinstance(sample, tuple):
            return self(*sample)
        return self(sample)

