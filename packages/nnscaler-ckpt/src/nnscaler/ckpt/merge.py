"""`merge`: a sharded or deduped checkpoint -> the merged (Hugging Face) layout, offline.

Streams one full tensor at a time (assembled from its pieces by `reshard`, written by
`SafetensorsWriter`), so peak memory is about the largest tensor, not the model. Output:
``model.safetensors`` or ``model-0000k-of-0000n.safetensors`` + ``model.safetensors.index.json``
with the single-device ``state_dict()`` names (persistent entries; a tied weight once, under the
name ``safetensors.torch.save_model`` keeps: the first in sorted order), ``optimizer.safetensors``
(``<parameter>.<state>``), ``rng.safetensors`` (each source rank's RNG states and extra tensors,
``rank-0000r/...``) and the manifest. No process group, no GPU.

Throughput: a tensor cut along dim 0 is copied by the kernel while helper threads hash it (the
output's SHA-256 and CRC-32, one thread each); the sources are checked by another helper thread
meanwhile; a finished model shard is hashed and fsynced while the next is written. The output's
SHA-256 (~2 GB/s on one core, one sequential stream per file) is what bounds a merge.
"""
from __future__ import annotations

import datetime
import json
import math
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Tuple, Union

import torch

from .checksums import bytes_record, verify_level
from .commit import StagingDir, new_token
from .hf_export import hf_plan, read_hf_record, write_hf_files
from .manifest import read_manifest
from .records import FileRecord, Manifest, MergeSource, ModelPiece, OptimizerPiece, RankRecord, TensorInfo
from .names import MERGED_INDEX, MERGED_MODEL, MERGED_OPTIMIZER, MERGED_RNG, merged_shard
from .replace_guard import check_merge_destination
from .reshard import model_region, model_segments, optimizer_region, optimizer_segments
from .safetensors_file import write_record
from .sizes import parse_size
from .sources import Sources
from .merge_check import SourceCheck
from .merge_writer import Whole, slabs, write_files

__all__ = ["merge", "Progress", "write_model", "merged_manifest"]

Progress = Callable[[int, int, str], None]  # (bytes done, bytes in all, tensor name)
_META = {"format": "pt"}


def _itemsize(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


def _model_plan(manifest: Manifest) -> List[Tuple[str, List[str], Tuple[int, ...], str, int]]:
    """(stored name, all names, shape, dtype, bytes) of every full tensor, in the manifest's order
    of the tensors (the order first saved: the saving ranks' local order, whichever rank stores
    which shard of a fully sharded tensor)."""
    stored = {rec.full_name for rec in manifest.model}
    order: Dict[str, None] = {n: None for n in manifest.tensors if n in stored}
    for rec in manifest.model:
        order.setdefault(rec.full_name, None)
    out = []
    for name in order:
        info = manifest.tensors[name]
        names = sorted({name, *info.aliases})
        shape = tuple(info.shape)
        out.append((names[0], [name, *info.aliases], shape, info.dtype, math.prod(shape) * _itemsize(info.dtype)))
    return out


def _split(plan, max_bytes: int) -> List[list]:
    files: List[list] = [[]]
    size = 0
    for item in plan:
        if files[-1] and size + item[4] > max_bytes:
            files.append([])
            size = 0
        files[-1].append(item)
        size += item[4]
    return files


def write_model(stage: StagingDir, plan, max_bytes: int, parts: Callable[[list, tuple, str], Iterable[torch.Tensor]],
                done: List[int], total: int, progress: Optional[Progress], segments: Optional[Dict[str, list]] = None):
    """The model files (and index) of a merged checkpoint (`merge_writer.write_files`); `plan`: see
    `_model_plan`; `parts(names, shape, dtype)` gives a tensor's slabs, `segments[name]` the byte
    ranges of other files to copy as they are, when it has some. Returns (file records, model piece
    records, the CRC-32 pieces of the copied bytes)."""
    split = _split(plan, max_bytes)
    files = [(MERGED_MODEL if len(split) == 1 else merged_shard(k, len(split)), items) for k, items in
             enumerate(split, 1)]
    by_name = {name: names for name, names, *_ in plan}
    records, pieces = write_files(stage, [(f, [(n, s, d, b) for n, _, s, d, b in items]) for f, items in files],
                                  lambda item: parts(by_name[item[0]], item[1], item[2]), segments or {}, done,
                                  total, progress)
    model, weight_map = [], {}
    for fname, items in files:
        for name, names, shape, dtype, _ in items:
            weight_map[name] = fname
            model.append(ModelPiece(file=fname, key=name, full_name=name, full_shape=tuple(shape),
                                    slices=tuple((0, d) for d in shape), value_split=(0, 1), dtype=dtype,
                                    aliases=[n for n in names if n != name]))
    if len(files) > 1:
        index = {"metadata": {"total_size": sum(p[4] for p in plan)}, "weight_map": dict(sorted(weight_map.items()))}
        data = (json.dumps(index, indent=2) + "\n").encode("utf-8")
        stage.file(MERGED_INDEX).write_bytes(data)
        records[MERGED_INDEX] = bytes_record(data)
    return records, model, pieces


def _optimizer_plan(src: Sources, stored: Dict[str, str]):
    """optimizer.safetensors: (its tensors, their values, the byte ranges to copy, the optimizer
    piece records): every state of every parameter, full shape, keyed ``<name>.<state>``."""
    items, values, segments, records = [], {}, {}, []
    table = src.manifest.tensors
    for (name, state), recs in sorted(src.optim.items()):
        key = f"{stored.get(name, name)}.{state}"
        shape = tuple(table[name].shape if name in table else recs[0].full_shape)
        base = dict(full_name=stored.get(name, name), state=state, full_shape=shape,
                    slices=tuple((0, d) for d in shape), start=0, stop=math.prod(shape), file=MERGED_OPTIMIZER)
        first = recs[0]
        if first.kind == "json":
            records.append(OptimizerPiece(**base, kind="json", value=first.value))
            continue
        if first.kind == "scalar":
            value = optimizer_region(src, name, state, ())
            items.append((key, tuple(value.shape), str(value.dtype).replace("torch.", ""),
                          value.numel() * value.element_size()))
            values[key] = Whole(lambda v=value: v)
            records.append(OptimizerPiece(**base, kind="scalar", key=key, dtype=first.dtype))
            continue
        items.append((key, shape, first.dtype, math.prod(shape) * _itemsize(first.dtype)))
        ranges = optimizer_segments(src, name, state, shape, first.dtype)
        if ranges is not None:
            segments[key] = ranges
        elif all(r.kind == "local" for r in recs):  # read in slabs of rows
            values[key] = slabs(lambda region, n=name, s=state: optimizer_region(src, n, s, region), shape,
                                first.dtype)
        else:  # ZeRO ranges of locals split along another dim: rebuilt whole
            values[key] = Whole(lambda n=name, s=state, r=tuple((0, d) for d in shape): optimizer_region(src, n, s, r))
        records.append(OptimizerPiece(**base, kind="local", key=key, dtype=first.dtype))
    return items, values, segments, records


def _write_rng(src: Sources, stage: StagingDir, manifest: Manifest) -> Tuple[Dict[str, FileRecord], list]:
    """Each source rank's RNG states and extra tensors, under ``rank-0000r/``."""
    items, ranks = [], []
    for r, info in enumerate(manifest.ranks):
        prefix = f"rank-{r:05d}/"
        for key in src.keys(info.file):
            if key.startswith(("rng/", "extra/")):
                items.append((prefix + key, src.read_key(info.file, key)))
        ranks.append(RankRecord(MERGED_RNG, info.rng, info.extra, prefix=prefix))
    return {MERGED_RNG: write_record(stage.file(MERGED_RNG), items, _META)}, ranks


def merged_manifest(plan, files: Dict[str, FileRecord], model: List[ModelPiece], *, world_size: int, plans,
                    source: MergeSource, optimizer=None, optimizer_state=(), ranks=()) -> Manifest:
    """The manifest of a merged checkpoint: `plan` as `_model_plan` gives it, `plans` the source's."""
    table = {name: TensorInfo(tuple(shape), dtype, [n for n in names if n != name])
             for name, names, shape, dtype, _ in plan}
    return Manifest(kind="merged", world_size=world_size, files=files, plan=plans, merged_from=source,
                    created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    tensors=table, optimizer=optimizer, model=model, optimizer_state=list(optimizer_state),
                    ranks=list(ranks))


def merge(src, dst, *, max_shard_size="5GB", model_only: bool = False, overwrite: bool = False,
          verify: Union[str, bool] = "fast", progress: Optional[Progress] = None, hf: bool = False) -> Path:
    """Merge checkpoint `src` into a new merged checkpoint `dst` (see the module docstring).
    Every source file is checked at level `verify` (`checksums`; default ``"fast"``: size and
    chunked CRC-32) by a helper thread while the merge runs; nothing is committed unless every
    file passes. `dst` must not exist; with `overwrite` it may also be an empty directory or an
    earlier merge output (a ``merged`` manifest and only its files), which is then replaced
    atomically; a `dst` equal to, inside or containing `src` is refused (`replace_guard`).
    With `hf`, `dst` is a directory ``transformers.AutoModelForCausalLM.from_pretrained`` loads
    (`hf_export`: the model only, under its own names, with config.json and the tokenizer).
    Returns `dst`."""
    src_root, dst = Path(src).absolute(), Path(dst).absolute()
    check_merge_destination(dst, overwrite, [src_root])
    manifest = read_manifest(src_root)
    level = verify_level(verify)
    max_bytes = parse_size(max_shard_size)
    stage = StagingDir(dst, new_token(), overwrite).create()
    try:
        _merge_into(stage, src_root, manifest, max_bytes, model_only, progress, level, hf)
    except BaseException:
        stage.discard()
        raise
    return dst


def _merge_into(stage, src_root: Path, manifest: Manifest, max_bytes: int, model_only: bool, progress,
                level: str, hf) -> None:
    with Sources(src_root, manifest, verify=False) as source:
        check, hf_record = None, None
        try:
            plan = _model_plan(manifest)
            if hf:  # hf_export: the Hugging Face names, config.json and tokenizer; no optimizer or RNG states
                hf_record, model_only = read_hf_record(source, manifest), True
                plan = hf_plan(plan, hf_record)
            segments = {}  # stored name -> the byte ranges to copy (pieces cut along dim 0 only)
            for name, names, shape, dtype, _ in plan:
                ranges = model_segments(source, names, shape, dtype)
                if ranges is not None:
                    segments[name] = ranges
            stored = {names[0]: name for name, names, *_ in plan}  # saved full name -> stored name
            optimizer = _optimizer_plan(source, stored) if not model_only and source.optim else None
            copied: Dict[str, list] = {}
            for ranges in [*segments.values(), *(optimizer[2].values() if optimizer else ())]:
                for path, offset, length in ranges:
                    copied.setdefault(Path(path).name, []).append((offset, length))
            check = SourceCheck(src_root, manifest, level, copied)  # a helper thread, meanwhile
            _write_all(stage, source, manifest, plan, segments, optimizer, max_bytes, model_only, progress, check,
                       hf_record)
        except BaseException as e:
            if check is None:  # failed before: check every file whole
                check = SourceCheck(src_root, manifest, level, {})
            bad = check.explain()  # a corrupt source explains a failure better than its effect
            if bad is not None and bad is not e:
                raise bad from None
            raise
        finally:
            if check is not None:
                check.close()


def _write_all(stage, source: Sources, manifest: Manifest, plan, segments, optimizer, max_bytes: int, model_only: bool,
               progress, check: SourceCheck, hf_record) -> None:
    total = sum(p[4] for p in plan) + (sum(item[3] for item in optimizer[0]) if optimizer else 0)
    done = [0]

    def parts(names, shape, dtype):
        return slabs(lambda region: model_region(source, names, shape, region, getattr(torch, dtype)), shape, dtype)
    files, model, pieces = write_model(stage, plan, max_bytes, parts, done, total, progress, segments)
    optimizer_state, ranks = [], []
    if optimizer is not None:
        items, values, ranges, optimizer_state = optimizer
        more, copied = write_files(stage, [(MERGED_OPTIMIZER, items)], lambda item: values[item[0]], ranges, done,
                                   total, progress)
        files.update(more)
        pieces += copied
    if not model_only and manifest.ranks:
        more, ranks = _write_rng(source, stage, manifest)
        files.update(more)
    if hf_record:
        files.update(write_hf_files(stage, hf_record, [p[3] for p in plan]))
    check.finish(pieces)  # every source file passed its check
    check_merge_destination(stage.dest, stage.overwrite, [source.root])  # still safe to replace
    stage.commit(merged_manifest(plan, files, model, world_size=manifest.world_size, plans=manifest.plan,
                                 source=MergeSource(manifest.kind, str(source.root)),
                                 optimizer=None if model_only else manifest.optimizer,
                                 optimizer_state=optimizer_state, ranks=ranks))
