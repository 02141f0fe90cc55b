"""Lightning's checkpoint dict <-> the JSON-with-tensors `extra` of nnscaler.ckpt.

Lightning's dict (epoch, global step, loops, callbacks, LR schedulers, hyper-parameters, ...)
holds a few things JSON cannot: tuples, dict keys that are not strings, non-finite floats, paths,
dtypes. They are tagged on the way in and restored on the way out, so the dict Lightning gets
back on resume is the one it saved. Anything else (an arbitrary object) is refused with its key:
nothing is ever pickled.
"""
from __future__ import annotations

import enum
import math
import os
from typing import Any

import torch

from .errors import NnScalerLightningError

__all__ = ["encode", "decode"]

_TAG = "__nnscaler_lightning__"


def encode(value: Any, path: str = "") -> Any:
    if isinstance(value, torch.Tensor) or value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, enum.Enum):
        if isinstance(value, float) and not math.isfinite(value):
            return {_TAG: "float", "value": repr(value)}
        return value
    if isinstance(value, dict):
        if all(isinstance(k, str) and k != _TAG for k in value):
            return {k: encode(v, f"{path}/{k}") for k, v in value.items()}
        return {_TAG: "dict", "items": [[encode(k, f"{path}/{k!r}"), encode(v, f"{path}/{k!r}")]
                                        for k, v in value.items()]}
    if isinstance(value, tuple):
        return {_TAG: "tuple", "items": [encode(v, f"{path}/{i}") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [encode(v, f"{path}/{i}") for i, v in enumerate(value)]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, enum.Enum):
        return encode(value.value, path)
    if isinstance(value, torch.dtype):
        return {_TAG: "dtype", "name": str(value).removeprefix("torch.")}
    raise NnScalerLightningError(
        f"the Lightning checkpoint holds a {type(value).__name__} at '{path or '/'}', which NnScalerStrategy "
        f"cannot store (checkpoints hold JSON values and tensors, never pickles): store a plain value there "
        f"(e.g. in on_save_checkpoint / save_hyperparameters(ignore=[...]))")


def decode(value: Any) -> Any:
    if isinstance(value, list):
        return [decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    tag = value.get(_TAG)
    if tag == "float":
        return float(value["value"])
    if tag == "dict":
        return {_hashable(decode(k)): decode(v) for k, v in value["items"]}
    if tag == "tuple":
        return tuple(decode(v) for v in value["items"])
    if tag == "dtype":
        return getattr(torch, value["name"])
    return {k: decode(v) for k, v in value.items()}


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key
