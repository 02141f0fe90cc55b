"""NnScalerPrecision: Lightning's `Precision` for NnScalerStrategy.

- ``"32-true"``: fp32 everywhere (the default; what ``Trainer(precision="32-true")`` becomes).
- ``"bf16-mixed"``: fp32 weights and optimizer, forward and loss under ``torch.autocast`` in
  bfloat16 (CPU and CUDA), like Lightning's `MixedPrecision`.
- ``"bf16-true"``: the module (before tracing) and floating inputs in bfloat16, like Lightning's
  `HalfPrecision`.
``"16-true"`` / ``"16-mixed"`` (which need a grad scaler) are refused with a clear error.

Gradient clipping by norm is the optimizer's `clip_gnorm(max_norm)` (nnscaler.runtime's
`build_optimizer`): Lightning's own runs `clip_grad_norm_` over this rank's parameters, which
under tensor parallelism are shards, so its norm would be the shard's. Clipping by value is
element-wise and is Lightning's own.
"""
from __future__ import annotations

import contextlib
from typing import Any, Generator, Union

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.pytorch.plugins.precision import Precision

from .errors import NnScalerLightningError

__all__ = ["NnScalerPrecision", "SUPPORTED_PRECISIONS"]

SUPPORTED_PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")
_ALIASES = {"32": "32-true", 32: "32-true", "bf16": "bf16-mixed"}


class NnScalerPrecision(Precision):
    """`NnScalerPrecision(precision="32-true")`: the precision plugin of `NnScalerStrategy`."""

    def __init__(self, precision: Union[str, int] = "32-true", *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        name = _ALIASES.get(precision, precision)
        if name not in SUPPORTED_PRECISIONS:
            raise NnScalerLightningError(
                f"NnScalerPrecision({precision!r}) is not supported yet; use one of "
                f"{', '.join(SUPPORTED_PRECISIONS)} (Trainer(precision=...))")
        self.precision = name

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return module.to(torch.bfloat16) if self.precision == "bf16-true" else module

    def convert_input(self, data: Any) -> Any:
        if self.precision != "bf16-true":
            return data
        return apply_to_collection(data, torch.Tensor, lambda t: t.to(torch.bfloat16) if t.is_floating_point() else t)

    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        if self.precision != "bf16-mixed":
            yield
            return
        device = "cuda" if torch.cuda.is_available() and torch.cuda.is_initialized() else "cpu"
        with torch.autocast(device, dtype=torch.bfloat16):
            yield

    def clip_grad_by_norm(self, optimizer: Any, clip_val: Union[int, float]) -> None:
        clip = getattr(optimizer, "clip_gnorm", None)
        if clip is None:
            raise NnScalerLightningError(
                f"gradient clipping by norm needs the optimizer NnScalerStrategy built, got "
                f"{type(optimizer).__name__}: return the optimizer from configure_optimizers and let the "
                f"strategy rebuild it")
        clip(float(clip_val))
