"""ParallelModule: the base class of the generated per-rank modules.

Contract for generated code (one module file per plan device, `gencode{d}.py`)::

    class GenModel(nnscaler.runtime.ParallelModule):
        COMPUTE_CONFIG = {...}   # ComputeConfig fields (dataclasses.asdict)
        RANK = 0                 # plan device this file was generated for (checked modulo plan_ngpus)
        SOURCE_MAP = {57: "model.py:42 in MLP.forward (layers.0): x = F.gelu(layer(x))"}
        FULL_NAMES = (...)       # optional: every full tensor name of the whole plan
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
import os
import sys
import types
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from nnscaler.ir.contracts import FullMapEntry
from nnscaler.ir.tree import map_tensors

from .device import default_device
from .errors import GenerationError, NnScalerError, PlanMismatchError
from .grid import RankGrid
from .gradients import scaled_loss
from .random import RandomStreamsMixin
from .reducer import Reducer, sync_grad_when
from . import failures

__all__ = ["ParallelModule", "FullMapEntry", "INIT_WEIGHTS_FILE"]

INIT_WEIGHTS_FILE = "fullmodel.safetensors"
_NOTE_PREFIX = "nnscaler: raised by "
_CONFIG_DEFAULTS = dict(constant_folding=False, trace_strategy="cuda_run_cpu_offload", use_zero=False,
                        zero_ngroups=1, zero_use_reduce_scatter=False, use_async_reducer=False,
                        reducer_bucket_cap_mb=None, inference_only=False, use_end2end=False, rng_mode="parallel", sync_batchnorm=False,
                        pas_config={}, user_config={})


def make_compute_config(data: Any):
    """`ComputeConfig` from its dict (an object with the fields is returned as is); a plain
    namespace with the documented defaults where nnscaler.ir is not importable."""
    if not isinstance(data, Mapping):
        return data
    try:
        from nnscaler.ir.config import ComputeConfig
    except ImportError:
        return types.SimpleNamespace(**{**_CONFIG_DEFAULTS, **data})
    from_dict = getattr(ComputeConfig, "from_dict", None)
    return from_dict(dict(data)) if from_dict else ComputeConfig(**data)


class ParallelModule(RandomStreamsMixin, torch.nn.Module):
    """One rank's share of a parallelized model. See the module docstring for the contract."""

    COMPUTE_CONFIG: Mapping[str, Any] = {"plan_ngpus": 1, "runtime_ngpus": 1}
    RANK: Optional[int] = None
    SOURCE_MAP: Mapping[int, str] = {}
    FULL_NAMES: Optional[Sequence[str]] = None
    PIPELINE: Optional[Mapping[str, Any]] = None  # set in pipelined plans (see pipeline.executor)
    # The mode the forward was traced in (the module starts in it) and, when the other mode runs
    # other ops (a Python branch on self.training), the user's line where they part (nnscaler.ir.modes).
    TRACED_TRAINING: bool = True
    MODE_DIVERGENCE: Optional[str] = None

    def __init__(self):
        super().__init__()
        self.training = bool(self.TRACED_TRAINING)
        self.compute_config = make_compute_config(self.COMPUTE_CONFIG)
        self.grid = RankGrid.get(self.compute_config.plan_ngpus, self.compute_config.runtime_ngpus)
        failures.arm()  # lets peers tell that this process died (failures.py)
        self.rank = self.grid.rank
        self.device = default_device()
        self.reducer: Optional[Reducer] = None
        self.shared_reducers: List[Reducer] = []  # pipeline devices holding one tensor: sum their grads
        self._pipeline_executor = None
        self._pipeline_nosync_depth = 0
        self._shared_synced = False
        self._fullmap: Dict[str, FullMapEntry] = {}
        self._full_aliases: Dict[str, str] = {}
        if self.RANK is not None and self.RANK % self.grid.plan_ngpus != self.grid.plan_device:
            raise PlanMismatchError(
                f"{type(self).__name__} was generated for plan device {self.RANK % self.grid.plan_ngpus} "
                f"but rank {self.rank} runs plan device {self.grid.plan_device} "
                f"(= rank % plan_ngpus): load gencode{self.grid.plan_device}.")

    # -- full map -------------------------------------------------------------------------------
    @property
    def fullmap(self) -> Mapping[str, FullMapEntry]:
        """local name -> FullMapEntry (read-only)."""
        return types.MappingProxyType(self._fullmap)

    @property
    def full_aliases(self) -> Mapping[str, str]:
        """Extra full name -> local name, for tied parameters (read-only)."""
        return types.MappingProxyType(self._full_aliases)

    def add_full_map(self, local_name: str, full_name: str, full_shape: Sequence[int],
                     slices: Sequence[Sequence[int]], value_split: Sequence[int] = (0, 1),
                     replicas: int = 1) -> None:
        """Record that local tensor `local_name` is `slices` of full tensor `full_name`."""
        tensor, _ = self._local_tensor(local_name)
        entry = FullMapEntry(local_name, full_name, tuple(int(d) for d in full_shape),
                             tuple((int(a), int(b)) for a, b in slices),
                             tuple(int(v) for v in value_split), int(replicas))
        problem = None
        if len(entry.slices) != len(entry.full_shape):
            problem = f"{len(entry.slices)} slices for a {len(entry.full_shape)}-d tensor"
        elif any(not 0 <= a <= b <= d for (a, b), d in zip(entry.slices, entry.full_shape)):
            problem = f"slices {entry.slices} outside full shape {entry.full_shape}"
        elif entry.local_shape != tuple(tensor.shape):
            problem = f"slices {entry.slices} give shape {entry.local_shape}, the tensor has {tuple(tensor.shape)}"
        elif len(entry.value_split) != 2 or not 0 <= entry.value_split[0] < entry.value_split[1]:
            problem = f"value_split {entry.value_split} is not (i, n) with 0 <= i < n"
        elif entry.replicas < 1:
            problem = f"replicas {entry.replicas} < 1"
        if problem:
            raise GenerationError(f"{type(self).__name__}.add_full_map({local_name!r} -> {full_name!r}): {problem}")
        self._fullmap[local_name] = entry

    def add_full_alias(self, full_name: str, local_name: str) -> None:
        """Declare that full tensor `full_name` is the same (tied) tensor as `local_name`."""
        if local_name not in self._fullmap:
            raise GenerationError(f"{type(self).__name__}.add_full_alias({full_name!r}, {local_name!r}): "
                                  f"call add_full_map({local_name!r}, ...) first")
        self._full_aliases[full_name] = local_name

    def _local_tensor(self, local_name: str) -> Tuple[torch.Tensor, bool]:
        """(tensor, required): required is False only for non-persistent buffers."""
        path, _, attr = local_name.rpartition(".")
        module = self.get_submodule(path) if path else self
        if attr in module._parameters and module._parameters[attr] is not None:
            return module._parameters[attr], True
        if attr in module._buffers and module._buffers[attr] is not None:
            return module._buffers[attr], attr not in module._non_persistent_buffers_set
        raise GenerationError(f"{type(self).__name__} has no parameter or buffer {local_name!r}")

    # -- initialisation -------------------------------------------------------------------------
    def _post_init(self, init_params: bool = True) -> None:
        """End of the generated __init__: device placement, initial weights, gradient reducer."""
        unmapped = [n for n, _ in self.named_parameters()] + [
            f"{m}.{b}".lstrip(".") for m, mod in self.named_modules() for b in mod._buffers
            if mod._buffers[b] is not None and b not in mod._non_persistent_buffers_set]
        unmapped = [n for n in unmapped if n not in self._fullmap]
        if unmapped:
            raise GenerationError(f"{type(self).__name__} registers {', '.join(unmapped)} without add_full_map: "
                                  f"regenerate the code (ReuseType.OVERRIDE)")
        if any(t.is_meta for t in (*self.parameters(), *self.buffers())):
            self.to_empty(device=self.device)
        else:
            self.to(self.device)
        if init_params:
            self._load_initial_weights()
        self._random_streams  # collective: rank 0's seed (runtime/random.py)
        cfg = self.compute_config
        trainable = self.parameters_for_optimizer()
        shared = self._shared_param_groups() if self.PIPELINE is not None else {}
        training = not getattr(cfg, "inference_only", False)
        bucket_cap = getattr(cfg, "reducer_bucket_cap_mb", None)
        for group, params in shared.items():
            if params and training:
                self.shared_reducers.append(Reducer(params, group=group, bucket_cap_mb=bucket_cap,
                                                    divisor=self.grid.dp_degree))
        in_shared = {id(p) for params in shared.values() for p in params}
        trainable = [p for p in trainable if id(p) not in in_shared]
        if self.grid.dp_degree > 1 and trainable and training:
            self.reducer = Reducer(trainable, group=self.grid.sync_group, bucket_cap_mb=bucket_cap,
                                   async_op=getattr(cfg, "use_async_reducer", False))

    def _shared_param_groups(self) -> Dict[Any, List[torch.nn.Parameter]]:
        """Process group -> this rank's parameters that several pipeline devices hold (a tied
        weight used by two stages, a Chimera stage's weights). Creates every such group on every
        rank, in the same order (collective)."""
        meta, grid = self.PIPELINE, self.grid
        n, units = grid.plan_ngpus, range(grid.dp_degree)
        groups = {}
        for holders in meta.get("shared_groups", []):
            ranks = tuple(sorted(u * n + d for u in units for d in holders))
            group = grid.group(ranks)
            if grid.plan_device in holders:
                groups[tuple(holders)] = group
        by_group: Dict[Any, List[torch.nn.Parameter]] = {g: [] for g in groups.values()}
        index = grid.plan_device % meta["tp_size"]
        for local, entry in self._fullmap.items():
            holders = meta.get("shared", {}).get(entry.full_name)
            tensor, _ = self._local_tensor(local)
            if holders and isinstance(tensor, torch.nn.Parameter) and tensor.requires_grad:
                by_group[groups[tuple(holders[index])]].append(tensor)
        return by_group

    def _sync_pipeline_grads(self) -> None:
        """End of a pipeline step: every reducer synchronises the accumulated gradients once."""
        for reducer in ([self.reducer] if self.reducer is not None else []) + self.shared_reducers:
            reducer.sync_grads()
        self._shared_synced = bool(self.shared_reducers)

    def _unshare_synced_grads(self) -> None:
        """Before accumulating on top of synced gradients: a tensor held by several pipeline
        devices has the same (summed) gradient on each; keep it on the first holder only, so the
        next sum counts it once (the data-parallel mean is unaffected: every unit keeps one)."""
        if not self._shared_synced:
            return
        self._shared_synced = False
        first = {name for name, per_index in self.PIPELINE.get("shared", {}).items()
                 if per_index[self.grid.plan_device % self.PIPELINE["tp_size"]][0] != self.grid.plan_device}
        for local, entry in self._fullmap.items():
            tensor, _ = self._local_tensor(local)
            if entry.full_name in first and tensor.grad is not None:
                tensor.grad.zero_()

    def _load_initial_weights(self) -> None:
        generated = _generated_file(type(self))
        path = Path(generated).parent / INIT_WEIGHTS_FILE if generated else Path(INIT_WEIGHTS_FILE)
        if not generated or not path.is_file():
            raise FileNotFoundError(
                f"{type(self).__name__}: initial weights {path} not found: regenerate the code, or build "
                f"the module with init_params=False and call load_full_state(state_dict)")
        from safetensors import safe_open
        with safe_open(str(path), framework="pt") as f:
            names = set(f.keys())

            def read(name: str, entry: FullMapEntry) -> torch.Tensor:
                if entry.is_whole:
                    return f.get_tensor(name)
                return f.get_slice(name)[tuple(slice(a, b) for a, b in entry.slices)]

            self._load_full(names, lambda name: tuple(f.get_slice(name).get_shape()), read, str(path), True)

    def load_full_state(self, tensors: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        """Fill every local tensor from FULL tensors by original (single-device) name.

        Missing names (a full name and all its aliases absent; non-persistent buffers are
        optional) and unexpected names raise PlanMismatchError when `strict`; unexpected means
        "not a tensor of the model", checked when this rank holds the whole model
        (plan_ngpus == 1) or the class lists FULL_NAMES. Shape mismatches always raise."""
        def read(name: str, entry: FullMapEntry) -> torch.Tensor:
            return tensors[name][tuple(slice(a, b) for a, b in entry.slices)]

        self._load_full(set(tensors), lambda name: tuple(tensors[name].shape), read, "the given state", strict)

    def _load_full(self, names: set, shape_of: Callable[[str], Tuple[int, ...]],
                   read: Callable[[str, FullMapEntry], torch.Tensor], origin: str, strict: bool) -> None:
        aliases: Dict[str, List[str]] = {}
        for full, local in self._full_aliases.items():
            aliases.setdefault(local, []).append(full)
        todo, missing, known = [], [], set(self._full_aliases)
        for local, entry in self._fullmap.items():
            known.add(entry.full_name)
            tensor, required = self._local_tensor(local)
            source = next((n for n in [entry.full_name, *aliases.get(local, [])] if n in names), None)
            if source is None:
                if required:
                    missing.append(entry.full_name)
                continue
            if shape_of(source) != entry.full_shape:
                raise PlanMismatchError(f"{source!r} in {origin} has shape {shape_of(source)}, the model "
                                        f"expects {entry.full_shape}")
            todo.append((tensor, entry, source))
        if self.FULL_NAMES is not None:
            known = set(self.FULL_NAMES)
        unexpected = sorted(names - known) if self.FULL_NAMES is not None or self.grid.plan_ngpus == 1 else []
        if strict and (missing or unexpected):
            raise PlanMismatchError(
                f"{origin} does not match the model:"
                + (f" missing {', '.join(missing)};" if missing else "")
                + (f" unexpected {', '.join(unexpected)};" if unexpected else "")
                + " pass the single-device model's state_dict (or strict=False to skip).")
        with torch.no_grad():
            for tensor, entry, source in todo:
                if entry.value_split[0] != 0:  # piece 0 holds the value, the others zeros
                    tensor.zero_()
                else:
                    tensor.copy_(read(source, entry))

    # -- running --------------------------------------------------------------------------------
    def _to_device(self, obj: Any) -> Any:
        return map_tensors(obj, lambda t: t if t.device == self.device else t.to(self.device))

    def forward(self, *args, **kwargs):
        if self.PIPELINE is not None:
            raise NnScalerError(f"{type(self).__name__} is pipelined (pipeline_scheduler "
                                f"{self.PIPELINE['scheduler']!r}): its stages run only inside train_step(samples) "
                                f"/ infer_step(samples), not through a plain forward call")
        failures.check_step(f"{type(self).__name__}.forward")  # refused after a failed step (failures.py)
        self._check_mode()
        args, kwargs = self._to_device((args, kwargs))
        try:
            with self.rng_scope():  # the module's random stream (runtime/random.py)
                out = self._forward_impl(*args, **kwargs)
        except Exception as exc:
            self._note_source(exc)
            failures.report(exc, "forward")  # peers waiting in a collective raise with it
            raise
        failures.watch_backward(out)  # a backward pass through `out` that raises is reported too
        return out

    def _check_mode(self) -> None:
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

    def _note_source(self, exc: BaseException) -> None:
        """Add a note naming the user's source line for the deepest generated frame in `exc`."""
        if any(str(n).startswith(_NOTE_PREFIX) for n in getattr(exc, "__notes__", ())):
            return
        generated = _generated_file(type(self))
        found, tb = None, exc.__traceback__
        while tb is not None:
            code = tb.tb_frame.f_code
            if generated and os.path.abspath(code.co_filename) == generated:
                where = self.SOURCE_MAP.get(tb.tb_lineno)
                if where is None:  # inside a multi-line statement: nearest mapped line above
                    above = [n for n in self.SOURCE_MAP if code.co_firstlineno <= n < tb.tb_lineno]
                    where = self.SOURCE_MAP[max(above)] if above else None
                if where is not None:
                    found = (where, tb.tb_lineno)
            tb = tb.tb_next
        if found:
            note = f"{_NOTE_PREFIX}{found[0]}\n  (generated code {generated}:{found[1]})"
            if hasattr(exc, "add_note"):
                exc.add_note(note)
            else:  # Python 3.10
                exc.__notes__ = [*getattr(exc, "__notes__", []), note]

    def sync_grad_when(self, cond: bool):
        """Inside `sync_grad_when(False)`, backward only accumulates this module's gradients
        (for a pipelined module: `train_step` leaves them unsynchronised)."""
        if self.PIPELINE is not None:
            return self._pipeline_nosync(cond)
        return self.reducer.sync_grad_when(cond) if self.reducer is not None else contextlib.nullcontext()

    @contextlib.contextmanager
    def _pipeline_nosync(self, cond: bool):
        if cond:
            yield
            return
        self._pipeline_nosync_depth += 1
        try:
            yield
        finally:
            self._pipeline_nosync_depth -= 1

    def parameters_for_optimizer(self) -> List[torch.nn.Parameter]:
        """This rank's trainable parameters."""
        return [p for p in self.parameters() if p.requires_grad]

    # -- end2end --------------------------------------------------------------------------------
    def _check_end2end(self, what: str, training: bool) -> None:
        cfg = self.compute_config
        if training and getattr(cfg, "inference_only", False):
            raise NnScalerError(f"{type(self).__name__}.{what}: the module was generated with "
                                f"inference_only=True; use infer_step, or regenerate with inference_only=False")
        if not getattr(cfg, "use_end2end", False):
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
            with sync_grad_when(i == len(samples) - 1):
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


def _generated_file(cls: type) -> Optional[str]:
    path = getattr(sys.modules.get(cls.__module__), "__file__", None)
    return os.path.abspath(path) if path else None
