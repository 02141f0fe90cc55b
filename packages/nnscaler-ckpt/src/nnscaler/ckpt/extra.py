"""The caller's ``extra``: a JSON-able dict in which tensors may appear anywhere; tensors are
stored in the rank's file (``extra/<path>``) and replaced in the JSON by ``{"__tensor__": key}``."""
from __future__ import annotations

import json
import math
from typing import Any, Callable, Dict, Tuple

import torch

from .errors import CheckpointError

__all__ = ["split_extra", "join_extra", "PREFIX"]

PREFIX = "extra/"
_TAG = "__tensor__"


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
