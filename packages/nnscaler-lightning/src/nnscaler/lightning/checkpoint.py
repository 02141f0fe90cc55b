"""Lightning checkpoints through nnscaler.ckpt.

A checkpoint is an nnscaler.ckpt directory (`state_dict_type` "sharded" or "deduped"): the
parallel module's weights and the optimizer's state as safetensors, and everything else Lightning
puts in its checkpoint dict (epoch, global step, loops, callbacks, LR schedulers, precision
state, hyper-parameters) in the `extra` of every rank (state_codec.py). Loading fills the module
and optimizer of any plan (nnscaler.ckpt reshards on load) and gives Lightning its dict back
with an empty ``state_dict`` and ``optimizer_states`` (already restored).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Union

import nnscaler.ckpt as ckpt

from .errors import NnScalerLightningError
from .state_codec import decode, encode

__all__ = ["save", "load", "merge", "EXTRA_KEY"]

EXTRA_KEY = "lightning"
_PARALLEL_KEYS = ("state_dict", "optimizer_states")


def save(path: Union[str, os.PathLike], checkpoint: Dict[str, Any], pm, optimizer, kind: str) -> Path:
    """Write `checkpoint` (Lightning's dict) with `pm` and `optimizer` to the directory `path`.
    COLLECTIVE. Overwrites what is there (ModelCheckpoint's ``last.ckpt``)."""
    rest = {k: v for k, v in checkpoint.items() if k not in _PARALLEL_KEYS}
    with_optimizer = "optimizer_states" in checkpoint and optimizer is not None
    extra = {EXTRA_KEY: encode(rest), "with_optimizer": with_optimizer}
    return ckpt.save(path, pm, optimizer if with_optimizer else None, kind=kind, extra=extra, overwrite=True)


def load(path: Union[str, os.PathLike], pm, optimizer) -> Dict[str, Any]:
    """Fill `pm` (and `optimizer`) from the checkpoint directory `path`; Lightning's dict back.
    COLLECTIVE."""
    path = Path(path)
    if not path.is_dir():
        what = "a file" if path.exists() else "missing"
        raise NnScalerLightningError(
            f"checkpoint {path} is {what}; NnScalerStrategy reads checkpoint directories written by "
            f"trainer.save_checkpoint / ModelCheckpoint with NnScalerStrategy (or nnscaler.ckpt.merge). "
            f"A single-device Lightning .ckpt file: load it into the model before creating the Trainer")
    extra = ckpt.load(path, pm, optimizer if _has_optimizer(path) else None)
    if not isinstance(extra, dict) or EXTRA_KEY not in extra:
        raise NnScalerLightningError(
            f"checkpoint {path} holds no Lightning state (it was not written by NnScalerStrategy): load its "
            f"weights with nnscaler.ckpt.load, or resume from a checkpoint of trainer.save_checkpoint")
    checkpoint = decode(extra[EXTRA_KEY])
    checkpoint["state_dict"] = {}
    if extra.get("with_optimizer"):
        checkpoint["optimizer_states"] = [{}]
    return checkpoint


def _has_optimizer(path: Path) -> bool:
    return bool(ckpt.inspect(path).get("optimizer"))


def checkpoint_dir(checkpoint_files: Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]]) -> Path:
    """The checkpoint directory of `checkpoint_files` (the directory, or files inside one)."""
    if isinstance(checkpoint_files, (str, os.PathLike)):
        checkpoint_files = [checkpoint_files]
    paths: List[Path] = [Path(p) for p in checkpoint_files]
    if not paths:
        raise NnScalerLightningError("merge_checkpoint: checkpoint_files is empty; pass the checkpoint directory "
                                     "or the files in it")
    dirs = {p if p.is_dir() else p.parent for p in paths}
    if len(dirs) != 1:
        raise NnScalerLightningError(
            f"merge_checkpoint: the files come from {len(dirs)} directories ({', '.join(sorted(map(str, dirs)))}); "
            f"a checkpoint is one directory: pass the files of one checkpoint, or the directory itself")
    return dirs.pop()


def merge(checkpoint_files, output_file: Union[str, os.PathLike], **kwargs: Any) -> Path:
    """`nnscaler.ckpt.merge` of the checkpoint directory into `output_file` (a directory in the
    merged Hugging Face layout), keeping Lightning's state so that ``fit(ckpt_path=output_file)``
    resumes from it under any plan."""
    return ckpt.merge(checkpoint_dir(checkpoint_files), output_file, **kwargs)
