"""Loading a Hugging Face model directory into a parallelized module: what `nnscaler.ckpt.load`
does with a directory that holds ``model.safetensors`` (or the shards listed in
``model.safetensors.index.json``, as ``save_pretrained`` writes them) and no ``manifest.json``.

Each rank reads only the regions of the tensors it holds (``safe_open(...).get_slice``, through
`Sources`, which treats the directory as a merged checkpoint of whole tensors): a tensor-parallel
shard reads its rows or columns, never the whole tensor. Names: the module's full names are the
files' as they are, or the files' under one common prefix (a wrapper holding the model as
``self.m``: ``m.model.layers.0.mlp.up_proj.weight``), found from the names of every rank and
refused when two prefixes fit equally well; a mixture of experts stored per expert fills the
module's fused expert tensors (`hf_names`: transformers' own renaming and fusing rules, each
per-expert tensor a piece of its fused tensor). Every rank checks the same things on the gathered
names: a persistent tensor of the module the files lack (by none of its names, a tied one's
included), a tensor of the files no rank's module has, and a shape that differs are errors naming
the tensor. The directory has no recorded hashes: its files are read as they are.
"""
from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Set, Tuple

import torch

from .collectives import all_gather_json, rank_and_world
from .errors import CheckpointError, describe
from .hf_names import Target, converted_name, targets
from .load import _model_values, _raise_if_any
from .module_tensors import local_tensors
from .names import MANIFEST
from .records import FileRecord, Manifest, ModelPiece, TensorInfo
from .safetensors_file import dtype_of, read_header
from .sources import Sources

__all__ = ["is_hf_directory", "hf_tensors", "match_prefix", "load_hf_directory"]

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"


def is_hf_directory(path) -> bool:
    """A directory without ``manifest.json`` holding ``model.safetensors`` or its index."""
    p = Path(path)
    return p.is_dir() and not (p / MANIFEST).exists() and ((p / SINGLE).is_file() or (p / INDEX).is_file())


def hf_tensors(root: Path) -> Dict[str, Tuple[str, Tuple[int, ...], str]]:
    """name -> (file, shape, dtype name) of every tensor of the directory (headers only)."""
    if (root / INDEX).is_file():
        try:
            files = sorted(set(json.loads((root / INDEX).read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{root / INDEX} is not a safetensors index ({type(e).__name__}: {e}): restore it "
                                  f"from the model's source") from None
    else:
        files = [SINGLE]
    out: Dict[str, Tuple[str, Tuple[int, ...], str]] = {}
    for name in files:
        if not (root / name).is_file():
            raise CheckpointError(f"{root / INDEX} lists {name}, which is not in {root}: copy the model's files "
                                  f"completely")
        try:
            header = read_header(root / name)
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{root / name} cannot be read as safetensors ({e}): copy the file again") from None
        for key, entry in header.items():
            if key != "__metadata__":
                out[key] = (name, tuple(entry["shape"]), str(dtype_of(entry["dtype"])).replace("torch.", ""))
    return out


def match_prefix(module_names: Iterable[str], file_names: Set[str], root) -> str:
    """The prefix (``""`` or ending in ``.``) under which the module's names are the files': the
    one most names fit; refused when none fits or two fit equally well."""
    module_names = list(module_names)
    scores: Counter = Counter()
    for name in module_names:
        parts = name.split(".")
        for i in range(len(parts)):
            if ".".join(parts[i:]) in file_names:
                scores[".".join(parts[:i]) + "." if i else ""] += 1
    if not scores:
        raise CheckpointError(f"{root}: none of the module's tensors ({', '.join(sorted(module_names)[:3])}, ...) is in "
                              f"the Hugging Face directory under any prefix (it holds "
                              f"{', '.join(sorted(file_names)[:3])}, ...): load the directory of this model")
    best = max(scores.values())
    top = sorted(p for p, s in scores.items() if s == best)
    if len(top) > 1:
        raise CheckpointError(f"{root}: the module's tensor names match the directory's equally well under the "
                              f"prefixes {', '.join(repr(p) for p in top)}: rename the module's attributes so that "
                              f"one common prefix holds the model")
    return top[0]


def _check(root: Path, everyone: List[list], found: Dict[str, Target], prefix: str) -> None:
    """Missing, unexpected and mis-shaped tensors over every rank's (names, full shape, persistent)."""
    missing, shapes, used = set(), set(), set()
    for names, shape, persistent in (t for rank in everyone for t in rank):
        keys = [n[len(prefix):] for n in names if n.startswith(prefix) and n[len(prefix):] in found]
        used.update(keys)
        if not keys:
            if persistent:
                missing.add(f"{names[0]}{list(shape)}")
            continue
        for key in keys:
            if tuple(found[key].shape) != tuple(shape):
                how = " (fused from its per-expert tensors)" if found[key].sources[0].squeezed else ""
                shapes.add(f"{key}{how} has shape {list(found[key].shape)} in the directory, the module's "
                           f"{names[0]} {list(shape)}")
    unexpected = sorted(k for name, t in found.items() if name not in used for k in t.file_names())
    if missing or shapes or unexpected:
        parts = ([f"missing {', '.join(sorted(missing))}"] if missing else []) + sorted(shapes) + \
                ([f"unexpected {', '.join(unexpected)}"] if unexpected else [])
        under = f" (the module's names under the prefix {prefix!r})" if prefix else ""
        raise CheckpointError(f"{root} does not hold this model{under}: {'; '.join(parts)}: load the Hugging Face "
                              f"directory of the model this module was built from (same config)")


def _manifest(root: Path, found: Dict[str, Target], prefix: str) -> Manifest:
    """The directory as a merged checkpoint whose full names are the module's (prefix + name): one
    piece per file tensor (a per-expert tensor is a piece of its fused tensor)."""
    files = sorted({s.file for t in found.values() for s in t.sources})
    records = {f: FileRecord(os.path.getsize(root / f), None) for f in files}
    model = [ModelPiece(s.key, prefix + name, t.shape, s.region, (0, 1), t.dtype, file=s.file)
             for name, t in found.items() for s in t.sources]
    tensors = {prefix + name: TensorInfo(t.shape, t.dtype) for name, t in found.items()}
    return Manifest("merged", 1, records, tensors=tensors, model=model)


class _Sources(Sources):
    """`Sources` that reads a per-expert tensor as its piece of the fused tensor (with the leading
    expert dimension of 1 it is stored without)."""

    def __init__(self, root, manifest: Manifest, squeezed: Set[str]):
        super().__init__(root, manifest, "size")
        self.squeezed = squeezed

    def read(self, rec, region=None) -> torch.Tensor:
        if rec.key not in self.squeezed:
            return super().read(rec, region)
        return self.read_key(rec.file, rec.key, tuple(region[1:]) if region else None).unsqueeze(0)


def load_hf_directory(path, module: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
    """Fill `module` (any plan) from Hugging Face directory `path`. COLLECTIVE; every rank raises
    the same error when any rank fails, and nothing changes then."""
    rank, _ = rank_and_world()
    root = Path(path).absolute()
    error, tensors, mine, squeezed = None, [], [], set()
    try:
        if optimizer is not None:
            raise CheckpointError(f"{root} is a Hugging Face model directory: it holds no optimizer state; call "
                                  f"nnscaler.ckpt.load(path, module) without the optimizer (it starts fresh)")
        tensors = local_tensors(module)
        mine = [[[lt.full_name, *lt.aliases], list(lt.full_shape), lt.persistent] for lt in tensors]
    except Exception as e:  # noqa: BLE001 - every rank must learn of it, or the others wait forever
        error = describe(e, rank)
    _raise_if_any(error)
    everyone = all_gather_json(mine)
    manifest = None
    try:
        files = hf_tensors(root)
        known = set(files) | {c for c in map(converted_name, files) if c is not None}
        prefix = match_prefix({n for rank_ in everyone for names, _, _ in rank_ for n in names}, known, root)
        shapes = {n[len(prefix):]: tuple(shape) for rank_ in everyone for names, shape, _ in rank_ for n in names
                  if n.startswith(prefix)}
        found = targets(root, files, shapes)
        _check(root, everyone, found, prefix)
        manifest = _manifest(root, found, prefix)
        squeezed = {s.key for t in found.values() for s in t.sources if s.squeezed}
    except Exception as e:  # noqa: BLE001
        error = describe(e, rank)
    _raise_if_any(error)
    values = []
    try:
        with _Sources(root, manifest, squeezed) as src:
            values = _model_values(src, tensors)
    except Exception as e:  # noqa: BLE001
        error = describe(e, rank)
    _raise_if_any(error)  # nothing was changed yet
    with torch.no_grad():
        for tensor, value in values:
            tensor.copy_(value)
