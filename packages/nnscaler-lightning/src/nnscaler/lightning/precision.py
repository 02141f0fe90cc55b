"""NnScalerPrecision: Lightning's `Precision` for NnScalerStrategy.

- ``"32-true"``: fp32 everywhere (the default; what ``Trainer(precision="32-true")`` becomes).
- ``"bf16-mixed"`` / ``"16-mixed"``: fp32 weights and optimizer, forward and loss under
  ``torch.autocast`` in bfloat16 / float16 (CPU and CUDA), like Lightning's `MixedPrecision`.
- ``"bf16-true"`` / ``"16-true"``: the module (before tracing) and floating inputs in bfloat16 /
  float16, like Lightning's `HalfPrecision`.
The fp16 kinds train with a grad scaler (`NnScalerGradScaler`: its overflow check spans every
rank); its state is the plugin's `state_dict`, which Lightning puts in the checkpoint (JSON).

Gradient clipping by norm is the optimizer's `clip_gnorm(max_norm)` (nnscaler.runtime's
`build_optimizer`): Lightning's own runs `clip_grad_norm_` over this rank's parameters, which
under tensor parallelism are shards, so its norm would be the shard's. Clipping by value is
element-wise and is Lightning's own, over `main_params` (the gradients the step consumes: ZeRO
shards, the device side of cpu_offload). With a scaler, gradients are unscaled before clipping.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Generator, Optional, Union

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.pytorch.plugins.precision import Precision
from nnscaler.runtime import step_gradients

from .errors import NnScalerLightningError
from .grad_scaler import NnScalerGradScaler

__all__ = ["NnScalerPrecision", "SUPPORTED_PRECISIONS", "PrecisionKind", "adopt_precision_plugin"]

SUPPORTED_PRECISIONS = ("32-true", "bf16-mixed", "bf16-true", "16-mixed", "16-true")
_ALIASES = {"32": "32-true", 32: "32-true", "bf16": "bf16-mixed", "16": "16-mixed", 16: "16-mixed"}
_DTYPES = {"bf16": torch.bfloat16, "16": torch.float16, "32": torch.float32}


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


class PrecisionKind:
    """What the Trainer's and Fabric's plugins share: the name, the dtype, the scaler."""

    def _init_kind(self, precision: Union[str, int], scaler: Optional[torch.amp.GradScaler],
                   device: Optional[str], who: str) -> None:
        name = _ALIASES.get(precision, precision)
        if name not in SUPPORTED_PRECISIONS:
            raise NnScalerLightningError(
                f"{who}({precision!r}) is not supported; use one of {', '.join(SUPPORTED_PRECISIONS)} "
                f"(precision=...)")
        if scaler is not None and not name.startswith("16-"):
            raise NnScalerLightningError(f"{who}({name!r}, scaler=...): only '16-mixed' and '16-true' use a grad "
                                         f"scaler; leave scaler out")
        self.precision = name
        self.dtype = _DTYPES[name.split("-")[0]]
        self.device = device or _default_device()
        self._given_scaler = scaler
        self.scaler = NnScalerGradScaler.like(scaler, self.device, name) if name.startswith("16-") else None

    @property
    def is_true(self) -> bool:
        return self.precision.endswith("-true") and self.dtype != torch.float32

    @property
    def is_mixed(self) -> bool:
        return self.precision.endswith("-mixed")

    def set_device(self, device: str) -> None:
        """The accelerator's device type (the strategy's root device): autocast and the scaler."""
        if device == self.device:
            return
        self.device = device
        if self.scaler is not None and self.scaler._scale is None:  # not used yet: rebuild on the device
            self.scaler = NnScalerGradScaler.like(self._given_scaler, device, self.precision)

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return module.to(self.dtype) if self.is_true else module

    def convert_input(self, data: Any) -> Any:
        if not self.is_true:
            return data
        return apply_to_collection(data, torch.Tensor, lambda t: t.to(self.dtype) if t.is_floating_point() else t)

    def autocast(self):
        return torch.autocast(self.device, dtype=self.dtype) if self.is_mixed else contextlib.nullcontext()

    def main_params(self, optimizer) -> Any:
        """The tensors whose gradients the step consumes (clipping by value clips these): under
        ZeRO the shards (their gradients set first), with cpu_offload the tensors on the
        module's device rather than the copies (offload.step_gradients)."""
        return step_gradients(optimizer)

    def state_dict(self) -> Dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        if self.scaler is not None and state_dict:
            self.scaler.load_state_dict(state_dict)


class NnScalerPrecision(PrecisionKind, Precision):
    """`NnScalerPrecision(precision="32-true", scaler=None, device=None)`: the precision plugin of
    `NnScalerStrategy`. `scaler`: a ``torch.amp.GradScaler`` whose settings the fp16 kinds use
    (default: initial scale 2**16 for ``16-mixed``, 2**10 for ``16-true``). `device`: autocast's
    device type (default: the strategy's root device)."""

    def __init__(self, precision: Union[str, int] = "32-true", scaler: Optional[torch.amp.GradScaler] = None,
                 device: Optional[str] = None) -> None:
        super().__init__()
        self._init_kind(precision, scaler, device, "NnScalerPrecision")

    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        with self.autocast():
            yield

    def pre_backward(self, tensor: torch.Tensor, module) -> torch.Tensor:
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        return super().pre_backward(tensor, module)

    def optimizer_step(self, optimizer, model, closure: Callable[[], Any], **kwargs: Any) -> Any:
        if self.scaler is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        closure_result = closure()  # forward, backward (scaled), nothing else
        skip = closure_result is None and model.automatic_optimization  # backward skipped by the step
        if not skip:
            self.scaler.unscale_(optimizer)  # before clipping (in _after_closure); collective
        self._after_closure(model, optimizer)
        if skip:
            return closure_result
        result = self.scaler.step(optimizer, **kwargs)  # skipped when any rank found inf / NaN
        self.scaler.update()
        return result

    def clip_grad_by_norm(self, optimizer: Any, clip_val: Union[int, float]) -> None:
        clip = getattr(optimizer, "clip_gnorm", None)
        if clip is None:
            raise NnScalerLightningError(
                f"gradient clipping by norm needs the optimizer NnScalerStrategy built, got "
                f"{type(optimizer).__name__}: return the optimizer from configure_optimizers and let the "
                f"strategy rebuild it")
        clip(float(clip_val))

    def state_dict(self) -> Dict[str, Any]:
        return PrecisionKind.state_dict(self)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        PrecisionKind.load_state_dict(self, state_dict)


def adopt_precision_plugin(plugin, ours: type, who: str, how: str):
    """The precision plugin a strategy (`who`) trains with: ours as it is; Lightning's own plugin
    of a supported precision (what ``{how}(precision=...)`` makes) replaced by `ours` with its
    scaler's settings; anything else refused, saying what to pass instead."""
    name = getattr(plugin, "precision", None)
    if plugin is not None and not isinstance(plugin, ours) and name in SUPPORTED_PRECISIONS \
            and type(plugin).__name__ in ("Precision", "MixedPrecision", "HalfPrecision"):
        plugin = ours(name, scaler=getattr(plugin, "scaler", None), device=getattr(plugin, "device", None))
    if plugin is not None and not isinstance(plugin, ours):
        from .errors import NnScalerLightningError
        raise NnScalerLightningError(
            f"{who} cannot train with the precision plugin {type(plugin).__name__} (precision={name!r}): use "
            f"{how}(precision=...) with one of {', '.join(SUPPORTED_PRECISIONS)}, or "
            f"plugins=[{ours.__module__.rsplit('.', 1)[0]}.NnScalerPrecision(...)]")
    return plugin
