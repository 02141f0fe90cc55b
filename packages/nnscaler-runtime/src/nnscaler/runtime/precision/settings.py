"""Precision settings: PrecisionConfig and parse_precision (the Trainer's values and Lightning's names)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Union

import torch

from ..errors import ConfigError

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
