"""Lightning's checkpoint dict <-> the JSON-with-tensors `extra` of nnscaler.ckpt.

Lightning's dict (epoch, global step, loops, callbacks, LR schedulers, hyper-parameters, ...)
holds a few things JSON cannot: tuples, dict keys that are not strings, non-finite floats, paths,
dtypes. nnscaler.ckpt's `encode_extra` / `decode_extra` tag them on the way in and restore them on
the way out, so the dict Lightning gets back on resume is the one it saved. Anything else (an
arbitrary object) is refused with its key: nothing is ever pickled.
"""
from __future__ import annotations

from typing import Any

from nnscaler.ckpt import decode_extra, encode_extra

from .errors import NnScalerLightningError

__all__ = ["encode", "decode"]


def _refuse(path: str, value: Any) -> Exception:
    return NnScalerLightningError(
        f"the Lightning checkpoint holds a {type(value).__name__} at '{path or '/'}', which NnScalerStrategy "
        f"cannot store (checkpoints hold JSON values and tensors, never pickles): store a plain value there "
        f"(e.g. in on_save_checkpoint / save_hyperparameters(ignore=[...]))")


def encode(value: Any, path: str = "") -> Any:
    """`value` as JSON with tensors (see nnscaler.ckpt.encode_extra)."""
    return encode_extra(value, path, refuse=_refuse)


def decode(value: Any) -> Any:
    """The inverse of `encode`; also reads checkpoints written with the older tag."""
    return decode_extra(value)
