"""The caller's ``extra``: a JSON-able dict in which tensors may appear anywhere; tensors are
stored in the rank's file (``extra/<path>``) and replaced in the JSON by ``{"__tensor__": key}``.

`encode_extra` / `decode_extra` carry what JSON cannot hold (tuples, non-string keys, non-finite
floats, dtypes, paths, enums) through an ``extra`` and back; the Trainer and Lightning use them for
their states (scheduler, scaler, Lightning's checkpoint dict)."""
from __future__ import annotations

import enum
import json
import math
import os
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from .errors import CheckpointError

__all__ = ["split_extra", "join_extra", "encode_extra", "decode_extra", "PREFIX"]

PREFIX = "extra/"
_TAG = "__tensor__"
_CODEC_TAG = "__nnscaler__"
# Older checkpoints: Lightning tagged with this name; the Trainer stored tensors inline as
# {"__tensor__": [values], "dtype": ..., "shape": [...]}. Both are still read.
_OLD_CODEC_TAGS = (_CODEC_TAG, "__nnscaler_lightning__")


def split_extra(extra: Any) -> Tuple[Any, Dict[str, torch.Tensor]]:
    """(JSON with tensor references, {key: tensor})."""
    if extra is None:
        return None, {}
    if not isinstance(extra, dict):
        raise CheckpointError(f"save(extra=...) must be a dict (JSON values and tensors), got {type(extra).__name__}")
    tensors: Dict[str, torch.Tensor] = {}

    def walk(value: Any, path: str) -> Any:
        if isinstance(value, torch.Tensor):
            key = f"{PREFIX}{path}"
            tensors[key] = value.detach().cpu()
            return {_TAG: key}
        if isinstance(value, dict):
            out = {}
            for k, v in value.items():
                if not isinstance(k, str):
                    raise CheckpointError(f"save(extra=...): key {k!r} at '{path or '.'}' is not a string; JSON "
                                          f"needs string keys")
                out[k] = walk(v, f"{path}/{k}" if path else k)
            return out
        if isinstance(value, (list, tuple)):
            return [walk(v, f"{path}/{i}") for i, v in enumerate(value)]
        if isinstance(value, float) and not math.isfinite(value):
            raise CheckpointError(f"save(extra=...): '{path}' is {value}, which JSON cannot hold; store it as a "
                                  f"tensor or a string")
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        raise CheckpointError(f"save(extra=...): '{path}' is a {type(value).__name__}, not a JSON value or a "
                              f"tensor; convert it (e.g. its state_dict()) first")
    data = walk(extra, "")
    json.dumps(data)
    return data, tensors


def join_extra(data: Any, read: Callable[[str], torch.Tensor]) -> Any:
    """The inverse of `split_extra`; `read(key)` returns a stored tensor."""
    if isinstance(data, dict):
        if set(data) == {_TAG}:
            return read(data[_TAG])
        return {k: join_extra(v, read) for k, v in data.items()}
    if isinstance(data, list):
        return [join_extra(v, read) for v in data]
    return data


def encode_extra(value: Any, path: str = "",
                 refuse: Optional[Callable[[str, Any], Exception]] = None) -> Any:
    """`value` as JSON with tensors, tagging what JSON cannot hold (tuples, non-string keys,
    non-finite floats, dtypes; paths and enums become their values); `decode_extra` inverts it.
    Any other object raises ``refuse(path, value)`` (default: a CheckpointError naming the path)."""
    def rec(v: Any, p: str) -> Any:
        if isinstance(v, torch.Tensor) or v is None or isinstance(v, (bool, str)):
            return v
        if isinstance(v, (int, float)) and not isinstance(v, enum.Enum):
            if isinstance(v, float) and not math.isfinite(v):
                return {_CODEC_TAG: "float", "value": repr(v)}
            return v
        if isinstance(v, dict):
            if all(isinstance(k, str) and k not in _OLD_CODEC_TAGS and k != _TAG for k in v):
                return {k: rec(x, f"{p}/{k}") for k, x in v.items()}
            return {_CODEC_TAG: "dict", "items": [[rec(k, f"{p}/{k!r}"), rec(x, f"{p}/{k!r}")] for k, x in v.items()]}
        if isinstance(v, tuple):
            return {_CODEC_TAG: "tuple", "items": [rec(x, f"{p}/{i}") for i, x in enumerate(v)]}
        if isinstance(v, list):
            return [rec(x, f"{p}/{i}") for i, x in enumerate(v)]
        if isinstance(v, os.PathLike):
            return os.fspath(v)
        if isinstance(v, enum.Enum):
            return rec(v.value, p)
        if isinstance(v, torch.dtype):
            return {_CODEC_TAG: "dtype", "name": str(v).removeprefix("torch.")}
        if refuse is not None:
            raise refuse(p, v)
        raise CheckpointError(f"extra: '{p or '/'}' is a {type(v).__name__}, not a JSON value, tensor, tuple, dtype "
                              f"or path; store a plain value (e.g. its state_dict()) there")
    return rec(value, path)


def decode_extra(value: Any) -> Any:
    """The inverse of `encode_extra` (also reads the older tags and inline tensors)."""
    if isinstance(value, list):
        return [decode_extra(v) for v in value]
    if not isinstance(value, dict):
        return value
    tag = next((value[t] for t in _OLD_CODEC_TAGS if t in value), None)
    if tag == "float":
        return float(value["value"])
    if tag == "dict":
        return {_hashable(decode_extra(k)): decode_extra(v) for k, v in value["items"]}
    if tag == "tuple":
        return tuple(decode_extra(v) for v in value["items"])
    if tag == "dtype":
        return getattr(torch, value["name"])
    if isinstance(value.get(_TAG), list) and set(value) == {_TAG, "dtype", "shape"}:
        return torch.tensor(value[_TAG], dtype=getattr(torch, value["dtype"])).reshape(value["shape"])
    return {k: decode_extra(v) for k, v in value.items()}


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key
