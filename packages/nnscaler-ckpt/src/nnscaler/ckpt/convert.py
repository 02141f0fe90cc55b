"""`convert`: weights from elsewhere -> a merged checkpoint (for ``tracing_from_weights`` and
fine-tuning): a plain torch ``state_dict`` file (``.pt`` / ``.pth`` / ``.bin``), a ``.safetensors``
file, or a Hugging Face directory (``model.safetensors``, sharded safetensors with their index, or
``pytorch_model*.bin``). A torch file is the one place this package reads a pickle: with
``torch.load(weights_only=True)`` (no code runs) and a `PickleReadWarning`. Tensors that share
storage (tied weights) are stored once, under the name ``safetensors.torch.save_model`` keeps.
"""
from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Dict, List

import torch
from safetensors import safe_open

from nnscaler.ir import NnScalerWarning

from .commit import StagingDir, new_token
from .errors import CheckpointError
from .merge import Progress, merged_manifest, write_model
from .merge_writer import slabs
from .records import MergeSource
from .replace_guard import check_merge_destination
from .sizes import parse_size

__all__ = ["convert", "PickleReadWarning"]

_PICKLED = (".pt", ".pth", ".bin", ".ckpt")


class PickleReadWarning(NnScalerWarning):
    """A torch file (a pickle) is being read, restricted to tensors (weights_only=True)."""


def _torch_file(path: Path) -> Dict[str, torch.Tensor]:
    warnings.warn(f"reading {path}, a pickle, with torch.load(weights_only=True): only tensors and plain "
                  f"containers are accepted and no code runs; prefer safetensors", PickleReadWarning, stacklevel=3)
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:
        raise CheckpointError(f"{path} cannot be read with torch.load(weights_only=True) ({type(e).__name__}: {e}): "
                              f"save a plain state_dict (tensors only) and convert that") from None
    for key in ("state_dict", "model", "module"):
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
            break
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        bad = [k for k, v in obj.items() if not isinstance(v, torch.Tensor)][:3] if isinstance(obj, dict) else []
        raise CheckpointError(f"{path} is not a state_dict of tensors (e.g. {bad or type(obj).__name__}): save "
                              f"model.state_dict() and convert that")
    return obj


def _safetensors_files(paths: List[Path]):
    """(name -> (shape, dtype, group key)), fetch(name, region)) of safetensors files (nothing
    loaded; a region is read alone)."""
    where: Dict[str, Path] = {}
    metas: Dict[str, tuple] = {}
    for p in paths:
        with safe_open(str(p), framework="pt") as f:
            for k in f.keys():
                sl = f.get_slice(k)
                where[k] = p
                metas[k] = (tuple(sl.get_shape()), _ST_DTYPES.get(sl.get_dtype(), sl.get_dtype().lower()), k)

    def fetch(name: str, region) -> torch.Tensor:
        with safe_open(str(where[name]), framework="pt") as f:
            return f.get_slice(name)[_slices(region)] if region else f.get_tensor(name)
    return metas, fetch


def _tensor_dict(tensors: Dict[str, torch.Tensor]):
    """The same for tensors in memory (memory-mapped); tensors sharing storage share a group key."""
    metas = {}
    for name, t in tensors.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()),
               t.dtype) if t.numel() else name
        metas[name] = (tuple(t.shape), str(t.dtype).replace("torch.", ""), key)
    return metas, lambda name, region: tensors[name][_slices(region)]


def _slices(region) -> tuple:
    return tuple(slice(a, b) for a, b in region)


def _sources(src: Path):
    """(name -> (shape, dtype, tie key)), fetch(name, region)) of the weights at `src`."""
    if src.is_dir():
        index = src / "model.safetensors.index.json"
        if index.is_file():
            return _safetensors_files(sorted({src / f for f in json.loads(index.read_text())["weight_map"].values()}))
        if (src / "model.safetensors").is_file():
            return _safetensors_files([src / "model.safetensors"])
        bins = sorted(src.glob("pytorch_model*.bin"))
        if not bins:
            raise CheckpointError(f"{src} holds no model.safetensors, model.safetensors.index.json or "
                                  f"pytorch_model*.bin: pass a Hugging Face model directory or a weights file")
        tensors: Dict[str, torch.Tensor] = {}
        for b in bins:
            tensors.update(_torch_file(b))
        return _tensor_dict(tensors)
    if src.suffix == ".safetensors":
        return _safetensors_files([src])
    if src.suffix in _PICKLED:
        return _tensor_dict(_torch_file(src))
    raise CheckpointError(f"{src}: not a weights file ({', '.join(_PICKLED)}, .safetensors) nor a Hugging Face "
                          f"directory")


_ST_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
              "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


def convert(src, dst, *, max_shard_size="5GB", overwrite: bool = False, progress: Progress = None) -> Path:
    """Write the weights at `src` as a merged checkpoint at `dst` (see the module docstring);
    `dst` and `overwrite` as for `merge` (only an earlier merge output is ever replaced)."""
    src, dst = Path(src).absolute(), Path(dst).absolute()
    if not src.exists():
        raise CheckpointError(f"{src} does not exist: pass a weights file or a Hugging Face model directory")
    check_merge_destination(dst, overwrite, [src])
    metas, fetch = _sources(src)
    groups: Dict[object, List[str]] = {}
    for name, (_, _, key) in metas.items():
        groups.setdefault(key, []).append(name)
    plan = []
    for names in groups.values():
        shape, dtype, _ = metas[names[0]]
        size = math.prod(shape) * torch.empty((), dtype=getattr(torch, dtype)).element_size()
        plan.append((sorted(names)[0], names, shape, dtype, size))
    stage = StagingDir(dst, new_token(), overwrite).create()
    try:
        def parts(names, shape, dtype):  # in slabs of rows: a few in memory, never two tensors
            return slabs(lambda region: fetch(names[0], region).to(getattr(torch, dtype)).contiguous(), shape, dtype)
        files, model, _ = write_model(stage, plan, parse_size(max_shard_size), parts, [0], sum(p[4] for p in plan),
                                      progress)
        check_merge_destination(dst, overwrite, [src])  # still safe to replace
        stage.commit(merged_manifest(plan, files, model, world_size=1, plans=None,
                                     source=MergeSource("converted", str(src))))
    except BaseException:
        stage.discard()
        raise
    return dst

