"""nnscaler.lightning.fabric.NnScalerPrecision: Fabric's `Precision` for its NnScalerStrategy.

The kinds of the Trainer's plugin (``32-true``, ``bf16-mixed``, ``16-mixed``, ``bf16-true``,
``16-true``; nnscaler.lightning.precision) with Fabric's hooks, as Fabric's own `MixedPrecision`
and `HalfPrecision` behave: floating inputs are cast to the precision's dtype and outputs back
to the default dtype; the mixed kinds run the forward under ``torch.autocast``, the true kinds
with that default dtype. The fp16 kinds scale the loss in `fabric.backward`, unscale before
`fabric.clip_gradients` and step through the scaler (`NnScalerGradScaler`: the overflow check
spans every rank). `fabric.save` / `load` with NnScalerStrategy keep its state (JSON).
"""
from __future__ import annotations

import contextlib
from typing import Any, Optional, Union

import torch
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.utilities.apply_func import apply_to_collection

from ..precision import PrecisionKind

__all__ = ["NnScalerPrecision"]


def _cast(data: Any, dtype: torch.dtype) -> Any:
    return apply_to_collection(data, torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t)


class NnScalerPrecision(PrecisionKind, Precision):
    """`NnScalerPrecision(precision="32-true", scaler=None, device=None)`, as the Trainer's."""

    def __init__(self, precision: Union[str, int] = "32-true", scaler: Optional[torch.amp.GradScaler] = None,
                 device: Optional[str] = None) -> None:
        self._init_kind(precision, scaler, device, "NnScalerPrecision")

    def trace_input(self, data: Any) -> Any:
        """The tracing input: cast for the true kinds only (the mixed ones trace fp32 weights
        without autocast; the generated forward takes any float dtype)."""
        return _cast(data, self.dtype) if self.is_true else data

    def convert_input(self, data: Any) -> Any:
        return _cast(data, self.dtype) if self.dtype != torch.float32 else data

    def convert_output(self, data: Any) -> Any:
        return _cast(data, torch.get_default_dtype()) if self.dtype != torch.float32 else data

    @contextlib.contextmanager
    def forward_context(self):
        if not self.is_true:
            with self.autocast():
                yield
            return
        default = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            yield
        finally:
            torch.set_default_dtype(default)

    def backward(self, tensor: torch.Tensor, model, *args: Any, **kwargs: Any) -> None:
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        tensor.backward(*args, **kwargs)

    def optimizer_step(self, optimizer, **kwargs: Any) -> Any:
        if self.scaler is None:
            return optimizer.step(**kwargs)
        result = self.scaler.step(optimizer, **kwargs)  # unscales first unless clip_gradients did
        self.scaler.update()
        return result

    def unscale_gradients(self, optimizer) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def state_dict(self):
        return PrecisionKind.state_dict(self)

    def load_state_dict(self, state_dict) -> None:
        PrecisionKind.load_state_dict(self, state_dict)
