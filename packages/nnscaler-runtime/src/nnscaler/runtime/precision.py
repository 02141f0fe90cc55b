"""Precision: per tensor type dtypes, mixed precision (autocast), fp32 master weights, loss scaling.

Four pieces, usable alone or together (``PrecisionPlugin`` strings them together for the Trainer
and the Lightning strategy):

``parse_precision(value) -> PrecisionConfig``
    The ``precision`` setting of the Trainer (``Union[str, Dict[str, str], None]``) and the five
    Lightning precision names:

    ===============  ======  ======  ======  =========  =========  ===========
    value            param   buffer  input   mixed      compute    grad scaler
    ===============  ======  ======  ======  =========  =========  ===========
    None / 'none'    --      --      --      no         --         no
    'fp32'           fp32    fp32    fp32    no         fp32       no
    'bf16'           bf16    bf16    bf16    no         bf16       no
    'fp16'           fp16    fp16    fp16    no         fp16       yes
    '32-true'        fp32    fp32    fp32    no         fp32       no
    'bf16-true'      bf16    bf16    bf16    no         bf16       no
    '16-true'        fp16    fp16    fp16    no         fp16       yes
    'bf16-mixed'     fp32    fp32    --      yes        bf16       no
    '16-mixed'       fp32    fp32    --      yes        fp16       yes
    ===============  ======  ======  ======  =========  =========  ===========

    A dict ``{'param': 'bf16', 'buffer': 'fp32', 'input': 'none'}`` sets each tensor type (a
    missing key is 'none': no conversion); the grad scaler is on when params are fp16.
    '--' (None) means "leave the tensor as it is". ``dataclasses.replace(cfg, grad_scaler=False)``
    changes a derived field.

``apply_precision(module, config)``
    Casts the floating parameters and buffers of a module (a ParallelModule or any nn.Module) in
    place -- the Parameter objects stay the same, so a Reducer or an optimizer that already holds
    them keeps working -- and installs a forward pre-hook that casts floating tensor inputs
    (nested in tuples, lists and dicts; positional and keyword) to the input dtype. In mixed mode
    the forward runs inside ``torch.autocast(device_type, dtype=compute_dtype)`` (entered by a
    forward pre-hook, left by an always-called forward hook) and its floating fp16/bf16 outputs
    are returned as fp32 (as Lightning does), so the loss is fp32. The hooks are picklable, so
    the module can still be deep-copied or saved whole.

``with_master_weights(optimizer)``
    Makes an optimizer over fp16/bf16 parameters step on fp32 master copies: the inner
    optimizer's ``param_groups`` hold the masters (so its state is fp32, and LR schedulers, which
    edit ``param_groups``, work unchanged); at ``step()`` the low-precision gradients are upcast
    into the masters, the inner step runs, and the masters are copied back (rounded to nearest)
    into the model's parameters. fp32 parameters are left as they are (nothing to do in mixed
    mode). The masters are saved in ``state_dict()['master_weights']``.

``GradScaler``
    ``torch.amp.GradScaler`` that (1) copies gradients into the master weights before unscaling,
    (2) unscales fp16 gradients too (pure fp16 training without masters), (3) all-reduces the
    inf/nan flag over the ranks, so every rank skips the same steps (with tensor parallelism the
    shards differ; a rank that saw no inf would otherwise step alone). The plain loop is::

        loss = pm(**batch)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)            # only when clipping: unscale BEFORE clipping
        opt.clip_gnorm(max_norm)
        scaler.step(opt)                # skipped when a gradient is inf/nan on any rank
        scaler.update()
        opt.zero_grad()

    Gradients must be unscaled before they are clipped (or their norm is read): a clip threshold
    applies to true gradients, and the scaled ones are ``scale`` times larger.
    ``PrecisionPlugin.clip_gnorm`` does this.

CPU: bf16 (true and mixed) and, with torch 2.13, fp16 too (forward/backward kernels of the usual
ops, fp16 autocast, GradScaler('cpu')) run on the CPU; see tests/runtime/test_precision.py.

Order: ``pm = parallelize(...)``; ``apply_precision(pm, cfg)``; ``opt = build_optimizer(pm, ...)``;
``opt = with_master_weights(opt)``; schedulers (``with_master_weights`` also works after a
scheduler was created). Gradient accumulation over micro-batches happens in the parameters'
dtype (bf16/fp16 in the ``-true`` modes); masters receive the accumulated gradient once per step.
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

import torch
import torch.distributed as dist

from .device import default_device, is_distributed
from .errors import ConfigError

__all__ = [
    "PrecisionConfig", "parse_precision", "apply_precision", "remove_precision", "get_precision",
    "cast_module", "cast_inputs", "autocast", "MixedPrecisionOptimizer", "with_master_weights", "GradScaler",
    "PrecisionPlugin", "TENSOR_TYPES", "PRECISIONS", "LIGHTNING_PRECISIONS",
]

TENSOR_TYPES = ("param", "buffer", "input")
PRECISIONS: Dict[str, Optional[torch.dtype]] = {
    "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "none": None}
LIGHTNING_PRECISIONS = ("32-true", "16-true", "bf16-true", "16-mixed", "bf16-mixed")
_LOW = (torch.float16, torch.bfloat16)
_NAMES = {v: k for k, v in PRECISIONS.items() if v is not None}


@dataclass(frozen=True)
class PrecisionConfig:
    """What `apply_precision`, `with_master_weights` and `PrecisionPlugin` do.

    param / buffer / input: the dtype floating tensors of that type are cast to; None: untouched.
    mixed: forward runs under ``torch.autocast(dtype=compute_dtype)`` (weights stay as `param`).
    compute_dtype: the autocast dtype when `mixed`; otherwise the dtype compute happens in
    (= `param`), for information.
    grad_scaler: scale the loss (fp16: gradients would underflow otherwise).
    """

    param: Optional[torch.dtype] = None
    buffer: Optional[torch.dtype] = None
    input: Optional[torch.dtype] = None
    mixed: bool = False
    compute_dtype: Optional[torch.dtype] = None
    grad_scaler: bool = False

    def __post_init__(self):
        for name in TENSOR_TYPES:
            value = getattr(self, name)
            if value is not None and value not in _NAMES:
                raise ConfigError(f"PrecisionConfig.{name} = {value!r}: expected one of "
                                  f"torch.float32, torch.float16, torch.bfloat16 or None")
        if self.mixed and self.compute_dtype not in _LOW:
            raise ConfigError(f"PrecisionConfig(mixed=True) needs compute_dtype torch.float16 or torch.bfloat16, "
                              f"got {self.compute_dtype!r}")

    @property
    def is_noop(self) -> bool:
        """Nothing to convert, no autocast, no scaling."""
        return self == PrecisionConfig()

    def describe(self) -> str:
        def name(d):
            return _NAMES.get(d, "none") if d is not None else "none"
        mode = f", mixed {name(self.compute_dtype)}" if self.mixed else ""
        return (f"param {name(self.param)}, buffer {name(self.buffer)}, input {name(self.input)}{mode}"
                + (", grad scaler" if self.grad_scaler else ""))


def _dtype_of(key: str, value: Any) -> Optional[torch.dtype]:
    if value is None or isinstance(value, torch.dtype) and value in _NAMES:
        return value
    if isinstance(value, str) and value.lower() in PRECISIONS:
        return PRECISIONS[value.lower()]
    raise ConfigError(f"precision[{key!r}] = {value!r} is not a precision: allowed values are "
                      f"{', '.join(repr(p) for p in PRECISIONS)} (or None)")


def parse_precision(value: Union[None, str, Mapping[str, Any], PrecisionConfig]) -> PrecisionConfig:
    """A `PrecisionConfig` from the Trainer's `precision` setting or a Lightning precision name
    (see the module docstring for the table). Raises ConfigError (a ValueError) naming the bad
    key or value and the allowed ones."""
    if value is None:
        return PrecisionConfig()
    if isinstance(value, PrecisionConfig):
        return value
    if isinstance(value, str):
        key = value.strip().lower()
        if key in PRECISIONS:
            dtype = PRECISIONS[key]
            return PrecisionConfig(dtype, dtype, dtype, compute_dtype=dtype, grad_scaler=dtype == torch.float16)
        if key in ("32-true", "16-true", "bf16-true"):
            dtype = {"32": torch.float32, "16": torch.float16, "bf16": torch.bfloat16}[key.split("-")[0]]
            return PrecisionConfig(dtype, dtype, dtype, compute_dtype=dtype, grad_scaler=dtype == torch.float16)
        if key in ("16-mixed", "bf16-mixed"):
            dtype = torch.float16 if key == "16-mixed" else torch.bfloat16
            return PrecisionConfig(torch.float32, torch.float32, None, mixed=True, compute_dtype=dtype,
                                   grad_scaler=dtype == torch.float16)
        raise ConfigError(f"precision {value!r} is not supported: use one of "
                          f"{', '.join(repr(p) for p in PRECISIONS)} (every tensor type), a dict "
                          f"{{'param': ..., 'buffer': ..., 'input': ...}}, or a Lightning precision "
                          f"{', '.join(repr(p) for p in LIGHTNING_PRECISIONS)}")
    if isinstance(value, Mapping):
        unknown = [k for k in value if k not in TENSOR_TYPES]
        if unknown:
            raise ConfigError(f"precision has unknown tensor type {unknown[0]!r}: allowed keys are "
                              f"{', '.join(repr(t) for t in TENSOR_TYPES)}")
        dtypes = {k: _dtype_of(k, value.get(k)) for k in TENSOR_TYPES}
        return PrecisionConfig(dtypes["param"], dtypes["buffer"], dtypes["input"], compute_dtype=dtypes["param"],
                               grad_scaler=dtypes["param"] == torch.float16)
    raise ConfigError(f"precision must be None, a str or a dict, got {type(value).__name__} {value!r}")


# -- module and inputs --------------------------------------------------------------------------------

def _map_floating(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """`fn` applied to every floating tensor in nested tuples (named too), lists and dicts."""
    if isinstance(obj, torch.Tensor):
        return fn(obj) if obj.is_floating_point() else obj
    if isinstance(obj, tuple):
        items = [_map_floating(o, fn) for o in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    if isinstance(obj, list):
        return [_map_floating(o, fn) for o in obj]
    if isinstance(obj, dict):
        items = [(k, _map_floating(v, fn)) for k, v in obj.items()]
        try:
            return type(obj)(items)
        except TypeError:  # e.g. defaultdict
            return dict(items)
    return obj


def _caster(dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda t: t if t.dtype == dtype else t.to(dtype)


def cast_inputs(obj: Any, config: Union[PrecisionConfig, str, Mapping, None]) -> Any:
    """`obj` (a tensor, or tensors nested in tuples/lists/dicts) with every floating tensor cast
    to the config's input dtype; non-floating tensors and other objects unchanged. Use it on the
    dummy inputs before tracing a model that runs in that precision."""
    dtype = parse_precision(config).input
    return obj if dtype is None else _map_floating(obj, _caster(dtype))


def cast_module(module: torch.nn.Module, config: Union[PrecisionConfig, str, Mapping, None]) -> torch.nn.Module:
    """Cast the floating parameters (and their gradients) and buffers of `module` in place to the
    config's param / buffer dtypes; no hooks. Parameter objects are kept (their `.data` changes)."""
    config = parse_precision(config)
    with torch.no_grad():
        for sub in module.modules():
            if config.param is not None:
                for p in sub._parameters.values():
                    if p is not None and p.is_floating_point() and p.dtype != config.param:
                        grad = p.grad
                        p.grad = None
                        p.data = p.data.to(config.param)
                        if grad is not None:
                            p.grad = grad.to(config.param)
            if config.buffer is not None:
                for name, b in sub._buffers.items():
                    if b is not None and b.is_floating_point() and b.dtype != config.buffer:
                        sub._buffers[name] = b.to(config.buffer)
    return module


def _device_type(module: torch.nn.Module) -> str:
    device = getattr(module, "device", None)
    if isinstance(device, torch.device):
        return device.type
    for t in module.parameters():
        return t.device.type
    for t in module.buffers():
        return t.device.type
    return default_device().type


def autocast(config: Union[PrecisionConfig, str, Mapping, None], device_type: Optional[str] = None):
    """The autocast context of a mixed config (`torch.autocast(device_type, compute_dtype)`), a
    null context otherwise."""
    config = parse_precision(config)
    if not config.mixed:
        return contextlib.nullcontext()
    return torch.autocast(device_type or default_device().type, dtype=config.compute_dtype)


class _CastInputs:
    """Forward pre-hook (with kwargs): floating tensor inputs -> `dtype`. Picklable."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def __call__(self, module, args, kwargs):
        cast = _caster(self.dtype)
        return _map_floating(args, cast), _map_floating(kwargs, cast)


def _to_fp32(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype in _LOW else t


class _Autocast:
    """Enters `torch.autocast` in a forward pre-hook and leaves it in a forward hook registered
    with `always_call=True` (so an exception in forward leaves it too); the hook also returns
    fp16/bf16 floating outputs as fp32. One stack of open contexts per thread (autocast state is
    thread-local; a module may be called recursively). Picklable and deep-copyable, so a module
    with precision applied still is."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self._local = threading.local()

    def __getstate__(self):
        return {"dtype": self.dtype}

    def __setstate__(self, state):
        self.__init__(state["dtype"])

    def enter(self, module, args):
        ctx = torch.autocast(_device_type(module), dtype=self.dtype)
        ctx.__enter__()
        self._local.__dict__.setdefault("stack", []).append(ctx)

    def exit(self, module, args, output):
        stack = self._local.__dict__.get("stack")
        if stack:
            stack.pop().__exit__(None, None, None)
        return None if output is None else _map_floating(output, _to_fp32)


def apply_precision(module: torch.nn.Module, config: Union[PrecisionConfig, str, Mapping, None]) -> torch.nn.Module:
    """Run `module` in `config`'s precision; returns the module (changed in place).

    Casts floating parameters/buffers (`cast_module`), installs a forward pre-hook casting
    floating tensor inputs to `config.input`, and in mixed mode runs forward under
    `torch.autocast(<module's device type>, dtype=config.compute_dtype)` (forward hooks; the
    module's forward itself is not replaced) returning fp16/bf16 floating outputs as fp32.
    Applying again replaces the previous hooks (parameters already cast stay cast);
    `remove_precision(module)` removes them.
    """
    config = parse_precision(config)
    if config.mixed and not torch.amp.is_autocast_available(_device_type(module)):
        raise ConfigError(f"precision {config.describe()}: torch.autocast is not available on device type "
                          f"{_device_type(module)!r}")
    remove_precision(module)
    cast_module(module, config)
    handles = []
    if config.input is not None:
        handles.append(module.register_forward_pre_hook(_CastInputs(config.input), with_kwargs=True))
    if config.mixed:
        hook = _Autocast(config.compute_dtype)
        handles.append(module.register_forward_pre_hook(hook.enter))  # after the input cast
        handles.append(module.register_forward_hook(hook.exit, prepend=True, always_call=True))
    module._nnscaler_precision = config
    module._nnscaler_precision_hooks = handles
    return module


def remove_precision(module: torch.nn.Module) -> None:
    """Remove the input cast and autocast that apply_precision installed (dtypes stay)."""
    handles = module.__dict__.pop("_nnscaler_precision_hooks", None)
    for handle in handles or ():
        handle.remove()
    module.__dict__.pop("_nnscaler_precision", None)


def get_precision(module: torch.nn.Module) -> Optional[PrecisionConfig]:
    """The config apply_precision installed on `module`, or None."""
    return module.__dict__.get("_nnscaler_precision")


# -- fp32 master weights ------------------------------------------------------------------------------

class MixedPrecisionOptimizer:
    """Mixed into the optimizer's class by `with_master_weights` (see the module docstring).

    `_mp_pairs`: (model parameter, fp32 master) for every fp16/bf16 parameter; the master
    replaces the parameter in `param_groups`. Master gradients exist only between
    `prepare_master_grads()` (called by step, clip_gnorm, scale_grads and GradScaler.unscale_)
    and the end of `step()` / `zero_grad()` / `GradScaler.update()`.
    """

    _mp_pairs: List[Tuple[torch.Tensor, torch.Tensor]]
    _mp_grads_ready: bool
    # GradScaler must take the unscale_ path (which calls prepare_master_grads), never the
    # fused-optimizer path that leaves unscaling to step().
    _step_supports_amp_scaling = False

    def _mp_convert_group(self, group: Dict[str, Any]) -> None:
        replicas = getattr(self, "_nnscaler_replicas", None)
        params = group["params"]
        for i, p in enumerate(params):
            if not (isinstance(p, torch.Tensor) and p.dtype in _LOW):
                continue
            master = torch.nn.Parameter(p.detach().to(torch.float32), requires_grad=p.requires_grad)
            params[i] = master
            self._mp_pairs.append((p, master))
            if isinstance(replicas, dict):  # build_optimizer's gradient-norm weights
                replicas[id(master)] = replicas.get(id(p), 1)
            if p in self.state:
                old = self.state.pop(p)
                self.state[master] = {k: v.to(torch.float32) if isinstance(v, torch.Tensor) and v.is_floating_point()
                                      and k != "step" else v for k, v in old.items()}

    @property
    def master_params(self) -> List[torch.Tensor]:
        """The fp32 masters, in the order of the low-precision parameters they stand for."""
        return [m for _, m in self._mp_pairs]

    def master_of(self, param: torch.Tensor) -> Optional[torch.Tensor]:
        """The fp32 master of a model parameter (None when it has none)."""
        return next((m for p, m in self._mp_pairs if p is param), None)

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        super().add_param_group(param_group)
        if hasattr(self, "_mp_pairs"):  # not during the base __init__
            self._mp_convert_group(self.param_groups[-1])

    def prepare_master_grads(self) -> None:
        """Upcast the model parameters' gradients into the masters' `.grad` (once per step).
        Completes pending ZeRO shard gradients first (`sync_shard_grad`, when the optimizer has it)."""
        if self._mp_grads_ready:
            return
        sync_shard_grad = getattr(self, "sync_shard_grad", None)
        if sync_shard_grad is not None:
            sync_shard_grad()
        with torch.no_grad():
            for p, m in self._mp_pairs:
                if p.grad is None:
                    m.grad = None
                elif m.grad is None or m.grad.shape != p.grad.shape:
                    m.grad = p.grad.detach().to(torch.float32)
                else:
                    m.grad.copy_(p.grad)
        self._mp_grads_ready = True

    def release_master_grads(self) -> None:
        """Drop the masters' gradients (the model's stay)."""
        for _, m in self._mp_pairs:
            m.grad = None
        self._mp_grads_ready = False

    def step(self, closure=None):
        loss = None
        if closure is not None:  # evaluated once, then the masters step on its gradients
            with torch.enable_grad():
                loss = closure()
        self.prepare_master_grads()
        super().step()
        with torch.no_grad():
            for p, m in self._mp_pairs:
                p.copy_(m)  # round to nearest
        self.release_master_grads()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.release_master_grads()
        super().zero_grad(set_to_none=set_to_none)
        for p, _ in self._mp_pairs:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                if p.grad.grad_fn is not None:
                    p.grad.detach_()
                else:
                    p.grad.requires_grad_(False)
                p.grad.zero_()

    def clip_gnorm(self, max_norm: Optional[float] = None) -> torch.Tensor:
        """Gradient norm (and clipping) over the fp32 master gradients; see build_optimizer."""
        self.prepare_master_grads()
        parent = super()
        if hasattr(parent, "clip_gnorm"):
            return parent.clip_gnorm(max_norm)
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, float("inf") if max_norm is None else max_norm)

    def scale_grads(self, factor: float) -> None:
        self.prepare_master_grads()
        parent = super()
        if hasattr(parent, "scale_grads"):
            return parent.scale_grads(factor)
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    p.grad.mul_(factor)

    def state_dict(self) -> Dict[str, Any]:
        """The inner optimizer's state dict (state of the masters, fp32) plus
        `'master_weights'`: {parameter index (as in 'state'): fp32 master}."""
        sd = super().state_dict()
        index, masters, seen = 0, {}, {}
        master_ids = {id(m) for _, m in self._mp_pairs}
        for group in self.param_groups:
            for p in group["params"]:
                seen.setdefault(id(p), index)
                if id(p) in master_ids:
                    masters[seen[id(p)]] = p.detach()
                index += 1
        sd["master_weights"] = masters
        return sd

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Loads the inner state; masters from `'master_weights'` when present (the model's
        parameters are then set to them, rounded), else from the model's parameters."""
        state_dict = dict(state_dict)
        saved = state_dict.pop("master_weights", None)
        super().load_state_dict(state_dict)
        index, positions = 0, {}
        for group in self.param_groups:
            for p in group["params"]:
                positions.setdefault(id(p), index)
                index += 1
        with torch.no_grad():
            for p, m in self._mp_pairs:
                i = positions.get(id(m))
                if saved is not None and i in saved:
                    m.copy_(saved[i])
                    p.copy_(m)
                else:
                    m.copy_(p)
        self.release_master_grads()


MixedPrecisionOptimizer.step.hooked = True  # step pre/post hooks run around the inner step (masters)

_MP_CLASSES: Dict[type, type] = {}


def _mp_class(base: type) -> type:
    if base not in _MP_CLASSES:
        _MP_CLASSES[base] = type(f"MasterWeights{base.__name__}", (MixedPrecisionOptimizer, base),
                                 {"__module__": base.__module__})
    return _MP_CLASSES[base]


def with_master_weights(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Make `optimizer` keep fp32 master weights for its fp16/bf16 parameters; returns the same
    object, now also an instance of `MixedPrecisionOptimizer` (and still of its own class, e.g.
    `torch.optim.Adam`, with build_optimizer's methods). Idempotent. Existing state is moved to
    the masters and upcast. May be called after an LR scheduler was created on it."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"with_master_weights: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(optimizer, MixedPrecisionOptimizer):
        return optimizer
    patched = optimizer.__dict__.get("step")
    if patched is not None and not getattr(patched, "_wrapped_by_lr_sched", False):
        raise ConfigError(f"with_master_weights: {type(optimizer).__name__}.step was replaced on the instance; "
                          f"call with_master_weights before wrapping step")
    optimizer.__class__ = _mp_class(type(optimizer))
    optimizer.__dict__.pop("_step_supports_amp_scaling", None)  # fused optimizers set it: unscale_ path
    optimizer._mp_pairs = []
    optimizer._mp_grads_ready = False
    for group in optimizer.param_groups:
        optimizer._mp_convert_group(group)
    if patched is not None:  # an LR scheduler wrapped the old class's step: wrap the new one
        ref = weakref.ref(optimizer)

        def step(*args, **kwargs):
            opt = ref()
            opt._opt_called = True
            return type(opt).step(opt, *args, **kwargs)

        step._wrapped_by_lr_sched = True
        optimizer.step = step
    return optimizer


# -- loss scaling -------------------------------------------------------------------------------------

class GradScaler(torch.amp.GradScaler):
    """`torch.amp.GradScaler` for nnscaler (see the module docstring): unscales master gradients
    of a `with_master_weights` optimizer, fp16 gradients too, and agrees on inf/nan across the
    ranks of `process_group` (default: all ranks; the check is then collective: every rank must
    call unscale_/step). `device`: 'cpu' or 'cuda' (default: the runtime's device type).

    `last_step_skipped`: whether the last `step()` was skipped; `skipped_steps`: how many were.
    """

    def __init__(self, device: Optional[str] = None, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, enabled: bool = True,
                 process_group=None, sync_found_inf: bool = True):
        device = device if device is not None else default_device().type
        super().__init__(str(torch.device(device).type), init_scale=init_scale, growth_factor=growth_factor,
                         backoff_factor=backoff_factor, growth_interval=growth_interval, enabled=enabled)
        self.process_group = process_group
        self.sync_found_inf = sync_found_inf
        self.last_step_skipped = False
        self.skipped_steps = 0
        self._mp_seen: List[weakref.ref] = []

    def __getstate__(self) -> Dict[str, Any]:
        state = super().__getstate__()
        state["_mp_seen"] = []
        state["process_group"] = None  # process groups do not pickle: the default group after loading
        return state

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        if self.is_enabled() and isinstance(optimizer, MixedPrecisionOptimizer):
            optimizer.prepare_master_grads()
            self._mp_seen.append(weakref.ref(optimizer))
        super().unscale_(optimizer)

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, True)
        if not (self.sync_found_inf and is_distributed() and dist.get_world_size(self.process_group) > 1):
            return per_device
        total = torch.zeros_like(found_inf)
        for value in per_device.values():
            total += value.to(total.device)
        dist.all_reduce(total, group=self.process_group)
        return {total.device: total}

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any):
        if not self.is_enabled():
            self.last_step_skipped = False
            return optimizer.step(*args, **kwargs)
        retval = super().step(optimizer, *args, **kwargs)  # calls our unscale_ when not yet done
        self.last_step_skipped = _step_skipped(self, optimizer)
        self.skipped_steps += int(self.last_step_skipped)
        return retval

    def update(self, new_scale=None) -> None:
        super().update(new_scale)
        for ref in self._mp_seen:  # a skipped step leaves the unscaled master grads behind
            opt = ref()
            if opt is not None:
                opt.release_master_grads()
        self._mp_seen.clear()


def _step_skipped(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> bool:
    """Whether scaler.step(optimizer) (just called, before update) skipped the step."""
    if not scaler.is_enabled():
        return False
    found = scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
    return bool(sum(v.item() for v in found.values()))


# -- the plug-in the Trainer and the Lightning strategy call -----------------------------------------

class PrecisionPlugin:
    """Everything precision does in a training loop, for the Trainer and the Lightning strategy.

        plugin = PrecisionPlugin('16-mixed')
        pm = plugin.setup_module(pm)                  # apply_precision
        opt = plugin.setup_optimizer(opt)             # fp32 masters when asked (or for fp16 params)
        loss = pm(**batch)
        plugin.backward(loss)                         # scaled when there is a grad scaler
        plugin.clip_gnorm(opt, max_norm)              # unscales first
        stepped = plugin.step(opt)                    # False when skipped on inf/nan
        opt.zero_grad()

    `grad_scaler`: None = as the config says; False = none; True = a new GradScaler; or a
    (torch.amp.)GradScaler instance to use. `master_weights`: None = only when params are fp16
    (pure fp16 Adam is unusable: eps and squared gradients underflow); True/False force it.
    """

    def __init__(self, precision: Union[None, str, Mapping[str, Any], PrecisionConfig] = None, *,
                 grad_scaler: Union[None, bool, torch.amp.GradScaler] = None,
                 master_weights: Optional[bool] = None, device: Optional[str] = None):
        self.config = parse_precision(precision)
        self.device_type = device if device is not None else default_device().type
        if grad_scaler is None:
            grad_scaler = self.config.grad_scaler
        if grad_scaler is True:
            grad_scaler = GradScaler(self.device_type)
        self.scaler: Optional[torch.amp.GradScaler] = grad_scaler or None
        self.master_weights = master_weights
        self._unscaled: set = set()

    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return apply_precision(module, self.config)

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        master = self.master_weights
        if master is None:
            master = self.config.param == torch.float16
        return with_master_weights(optimizer) if master else optimizer

    def convert_input(self, obj: Any) -> Any:
        return cast_inputs(obj, self.config)

    def forward_context(self):
        """Autocast for code outside the module's forward (the module itself is wrapped)."""
        return autocast(self.config, self.device_type)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def backward(self, loss: torch.Tensor, *args, **kwargs) -> None:
        self.scale_loss(loss).backward(*args, **kwargs)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale the gradients (once per step); required before clipping or reading them."""
        if self.scaler is not None and id(optimizer) not in self._unscaled:
            self.scaler.unscale_(optimizer)
            self._unscaled.add(id(optimizer))

    def clip_gnorm(self, optimizer: torch.optim.Optimizer, max_norm: Optional[float] = None) -> torch.Tensor:
        """Unscale, then the global gradient norm / clipping (`optimizer.clip_gnorm` of
        build_optimizer, else torch.nn.utils.clip_grad_norm_ over the optimizer's params)."""
        self.unscale_(optimizer)
        if hasattr(optimizer, "clip_gnorm"):
            return optimizer.clip_gnorm(max_norm)
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, float("inf") if max_norm is None else max_norm)

    def step(self, optimizer: torch.optim.Optimizer, *args, **kwargs) -> bool:
        """optimizer.step (through the scaler, which skips it on inf/nan and updates the scale);
        returns whether the parameters were updated."""
        self._unscaled.discard(id(optimizer))
        if self.scaler is None:
            optimizer.step(*args, **kwargs)
            return True
        self.scaler.step(optimizer, *args, **kwargs)
        skipped = _step_skipped(self.scaler, optimizer)
        self.scaler.update()
        return not skipped

    def state_dict(self) -> Dict[str, Any]:
        return {"scaler": self.scaler.state_dict()} if self.scaler is not None else {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
