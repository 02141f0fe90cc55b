"""(One file over 400 lines: the records nest into one schema, read and checked together.)
The records of ``manifest.json`` as typed objects: `Manifest` and the records it holds
(`FileRecord`, `TensorInfo`, `ModelPiece`, `OptimizerPiece`, `RankRecord`, `OptimizerInfo`,
`ModulePlan`, `MergeSource`). Code reads and builds them by attribute; they become JSON only at
the disk (and wire) boundary: ``to_json()`` gives exactly the JSON that was always written,
``from_json(data)`` checks the shape of what was read and raises `RecordError` naming the
offending field (`Manifest.from_json` turns it into a `CheckpointError` naming the file and the
fix). Fields older manifests lack are optional here; unknown fields are ignored.
``Manifest.dumps()`` / ``Manifest.loads(raw)`` are the bytes of ``manifest.json``: every writer
(the commit, the SHA-256 filled in after it) and every reader goes through them.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from .errors import CheckpointError
from .names import FORMAT, FORMAT_VERSION, KINDS

__all__ = ["Record", "RecordError", "Crc32", "FileRecord", "TensorInfo", "ModelPiece", "OptimizerPiece", "RankRecord",
           "OptimizerInfo", "ModulePlan", "MergeSource", "Manifest", "REQUIRED"]

REQUIRED = ("format", "format_version", "kind", "world_size", "files")
Region = Tuple[Tuple[int, int], ...]
_MISSING = object()


class RecordError(ValueError):
    """A JSON record has not the shape its type needs (`where` names the field)."""


class Record:
    """Base of the manifest records. ``record[name]`` reads the JSON field `name` (what
    `verify` and `read_manifest` returned before the records were typed); code uses attributes."""

    def to_json(self) -> Dict[str, Any]:
        raise NotImplementedError

    def __getitem__(self, key: str) -> Any:
        return self.to_json()[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.to_json().get(key, default)


def _get(data: Any, key: str, where: str, types, default: Any = _MISSING) -> Any:
    if not isinstance(data, dict):
        raise RecordError(f"{where or 'the manifest'} is a {type(data).__name__}, not an object")
    if key not in data:
        if default is _MISSING:
            raise RecordError(f"{where or 'the manifest'} lacks {key!r}")
        return default
    value = data[key]
    if value is None and default is None:
        return None
    if types is not None and (not isinstance(value, types) or (isinstance(value, bool) and bool not in
                                                                  (types if isinstance(types, tuple) else (types,)))):
        raise RecordError(f"{where + '.' if where else ''}{key} is {value!r} (expected {_type_names(types)})")
    return value


def _type_names(types) -> str:
    return " or ".join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))


def _ints(value: Any, where: str) -> Tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise RecordError(f"{where} is {value!r}, not a list of integers")
    return tuple(value)


def _region(value: Any, where: str) -> Region:
    if not isinstance(value, list):
        raise RecordError(f"{where} is {value!r}, not a list of [start, stop] pairs")
    out = tuple(_ints(v, f"{where}[{i}]") for i, v in enumerate(value))
    if any(len(p) != 2 for p in out):
        raise RecordError(f"{where} is {value!r}, not a list of [start, stop] pairs")
    return out


def _strs(value: Any, where: str) -> List[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise RecordError(f"{where} is {value!r}, not a list of strings")
    return list(value)


def _lists(region: Region) -> List[List[int]]:
    return [list(s) for s in region]


@dataclass
class Crc32:
    """The CRC-32 of every `chunk` bytes of a file (`checksums`)."""

    chunk: int
    values: List[int]

    def to_json(self) -> Dict[str, Any]:
        return {"chunk": self.chunk, "values": list(self.values)}

    @classmethod
    def from_json(cls, data: Any, where: str) -> "Crc32":
        return cls(_get(data, "chunk", where, int), list(_ints(_get(data, "values", where, list), f"{where}.values")))


@dataclass
class FileRecord(Record):
    """A file of the checkpoint: size, SHA-256 and (since the CRC existed) chunked CRC-32. A
    synchronous `save` records a rank file's size and CRC-32 only (``sha256`` None: hashing it
    would double the save's time); every record has at least one of the two hashes."""

    size: int
    sha256: Optional[str]
    crc32: Optional[Crc32] = None

    def to_json(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"size": self.size}
        if self.sha256 is not None:
            out["sha256"] = self.sha256
        if self.crc32 is not None:
            out["crc32"] = self.crc32.to_json()
        return out

    @classmethod
    def from_json(cls, data: Any, where: str = "file") -> "FileRecord":
        crc = _get(data, "crc32", where, dict, None)
        sha = _get(data, "sha256", where, str, None if crc is not None else _MISSING)  # one hash at least
        return cls(_get(data, "size", where, int), sha, None if crc is None else Crc32.from_json(crc, f"{where}.crc32"))


@dataclass
class TensorInfo(Record):
    """A full tensor: shape, dtype name (``float32``) and the other names of a tied tensor."""

    shape: Tuple[int, ...]
    dtype: str
    aliases: List[str] = field(default_factory=list)

    def to_json(self) -> Dict[str, Any]:
        return {"shape": list(self.shape), "dtype": self.dtype, "aliases": list(self.aliases)}

    @classmethod
    def from_json(cls, data: Any, where: str) -> "TensorInfo":
        return cls(_ints(_get(data, "shape", where, list), f"{where}.shape"), _get(data, "dtype", where, str),
                   _strs(_get(data, "aliases", where, list, []), f"{where}.aliases"))


@dataclass
class ModelPiece(Record):
    """A stored piece of a full model tensor: tensor `key` of `file`, region `slices` of the full
    tensor, value part `value_split` = (part, parts). Sharded and deduped checkpoints also record
    the saving `rank`, `replicas`, the local `shape` and the `piece` id ranks agree on."""

    key: str
    full_name: str
    full_shape: Tuple[int, ...]
    slices: Region
    value_split: Tuple[int, int]
    dtype: str
    aliases: List[str] = field(default_factory=list)
    file: Optional[str] = None
    rank: Optional[int] = None
    replicas: Optional[int] = None
    shape: Optional[Tuple[int, ...]] = None
    piece: Optional[str] = None

    def to_json(self) -> Dict[str, Any]:
        if self.rank is None and self.file is not None:  # a merged piece, in the order merge always wrote
            return {"file": self.file, "key": self.key, "full_name": self.full_name,
                    "full_shape": list(self.full_shape), "slices": _lists(self.slices),
                    "value_split": list(self.value_split), "dtype": self.dtype, "aliases": list(self.aliases)}
        out: Dict[str, Any] = {"key": self.key}
        if self.rank is not None:
            out["rank"] = self.rank
        out.update(full_name=self.full_name, full_shape=list(self.full_shape), slices=_lists(self.slices),
                   value_split=list(self.value_split))
        if self.replicas is not None:
            out["replicas"] = self.replicas
        out.update(aliases=list(self.aliases), dtype=self.dtype)
        if self.shape is not None:
            out["shape"] = list(self.shape)
        if self.piece is not None:
            out["piece"] = self.piece
        if self.file is not None:
            out["file"] = self.file
        return out

    @classmethod
    def from_json(cls, data: Any, where: str) -> "ModelPiece":
        split = _ints(_get(data, "value_split", where, list), f"{where}.value_split")
        if len(split) != 2:
            raise RecordError(f"{where}.value_split is {list(split)}, not [part, parts]")
        shape = _get(data, "shape", where, list, None)
        return cls(key=_get(data, "key", where, str), full_name=_get(data, "full_name", where, str),
                   full_shape=_ints(_get(data, "full_shape", where, list), f"{where}.full_shape"),
                   slices=_region(_get(data, "slices", where, list), f"{where}.slices"), value_split=split,
                   dtype=_get(data, "dtype", where, str),
                   aliases=_strs(_get(data, "aliases", where, list, []), f"{where}.aliases"),
                   file=_get(data, "file", where, str, None), rank=_get(data, "rank", where, int, None),
                   replicas=_get(data, "replicas", where, int, None),
                   shape=None if shape is None else _ints(shape, f"{where}.shape"),
                   piece=_get(data, "piece", where, str, None))


@dataclass
class OptimizerPiece(Record):
    """A stored piece of the optimizer state `state` of parameter `full_name`: elements
    [start, stop) of the local tensor at `slices`. `kind`: ``flat`` (a ZeRO range), ``local``
    (the whole local tensor), ``scalar`` (a per-parameter tensor) or ``json`` (a non-tensor
    `value`, no `key`)."""

    full_name: str
    state: str
    full_shape: Tuple[int, ...]
    slices: Region
    start: int
    stop: int
    kind: str
    key: Optional[str] = None
    dtype: Optional[str] = None
    value: Any = None
    file: Optional[str] = None
    rank: Optional[int] = None
    shape: Optional[Tuple[int, ...]] = None

    KINDS = ("flat", "local", "scalar", "json")

    @property
    def piece_id(self) -> str:
        """The same on every rank holding the same piece (deduped saves agree on it)."""
        return f"{self.full_name}|{self.state}|{_lists(self.slices)}|{self.start}:{self.stop}|{self.kind}"

    def to_json(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {} if self.rank is None else {"rank": self.rank}
        out.update(full_name=self.full_name, state=self.state, full_shape=list(self.full_shape),
                   slices=_lists(self.slices), start=self.start, stop=self.stop, kind=self.kind)
        if self.kind == "json":
            out["value"] = self.value
        out.update(key=self.key, dtype=self.dtype)
        if self.shape is not None:
            out["shape"] = list(self.shape)
        if self.file is not None:
            out["file"] = self.file
        return out

    @classmethod
    def from_json(cls, data: Any, where: str) -> "OptimizerPiece":
        kind = _get(data, "kind", where, str)
        if kind not in cls.KINDS:
            raise RecordError(f"{where}.kind is {kind!r}, not one of {', '.join(cls.KINDS)}")
        key = _get(data, "key", where, str, None)
        if kind != "json" and key is None:
            raise RecordError(f"{where} lacks 'key'")
        shape = _get(data, "shape", where, list, None)
        return cls(full_name=_get(data, "full_name", where, str), state=_get(data, "state", where, str),
                   full_shape=_ints(_get(data, "full_shape", where, list), f"{where}.full_shape"),
                   slices=_region(_get(data, "slices", where, list), f"{where}.slices"),
                   start=_get(data, "start", where, int), stop=_get(data, "stop", where, int), kind=kind, key=key,
                   dtype=_get(data, "dtype", where, str, None), value=data.get("value") if kind == "json" else None,
                   file=_get(data, "file", where, str, None), rank=_get(data, "rank", where, int, None),
                   shape=None if shape is None else _ints(shape, f"{where}.shape"))


@dataclass
class RankRecord(Record):
    """What one saving rank stored besides pieces: its file, the JSON of its RNG states
    (`rng.capture_rng`) and of the caller's ``extra`` (`extra.split_extra`); `prefix`: where a
    merged checkpoint keeps that rank's tensors (``rank-0000r/``)."""

    file: str
    rng: Optional[Dict[str, Any]] = None
    extra: Any = None
    prefix: Optional[str] = None

    def to_json(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"file": self.file}
        if self.prefix is not None:
            out["prefix"] = self.prefix
        out.update(rng=self.rng, extra=self.extra)
        return out

    @classmethod
    def from_json(cls, data: Any, where: str) -> "RankRecord":
        return cls(_get(data, "file", where, str), _get(data, "rng", where, dict, None), _get(data, "extra", where,
                                                                                            None, None),
                   _get(data, "prefix", where, str, None))


@dataclass
class OptimizerInfo(Record):
    """The optimizer: its class (``torch.optim.adam.Adam``) and each param group's settings."""

    cls: str
    param_groups: List[Dict[str, Any]]

    def to_json(self) -> Dict[str, Any]:
        return {"class": self.cls, "param_groups": self.param_groups}

    @classmethod
    def from_json(cls, data: Any, where: str) -> "OptimizerInfo":
        return cls(_get(data, "class", where, str), _get(data, "param_groups", where, list))


@dataclass
class ModulePlan(Record):
    """A parallelized module's identity: its path in the saved module, class, graph fingerprint
    and compute config."""

    path: str
    cls: str
    graph_fingerprint: Optional[str]
    compute_config: Dict[str, Any]

    def to_json(self) -> Dict[str, Any]:
        return {"path": self.path, "class": self.cls, "graph_fingerprint": self.graph_fingerprint,
                "compute_config": self.compute_config}

    @classmethod
    def from_json(cls, data: Any, where: str) -> "ModulePlan":
        return cls(_get(data, "path", where, str), _get(data, "class", where, str),
                   _get(data, "graph_fingerprint", where, None, None), _get(data, "compute_config", where, dict, {}))


@dataclass
class MergeSource(Record):
    """What a merged checkpoint was made from: a checkpoint's kind (or ``converted``) and path."""

    kind: str
    path: str

    def to_json(self) -> Dict[str, Any]:
        return {"kind": self.kind, "path": self.path}

    @classmethod
    def from_json(cls, data: Any, where: str) -> "MergeSource":
        return cls(_get(data, "kind", where, str), _get(data, "path", where, str))


def _items(data: Any, key: str, parse, default=_MISSING) -> list:
    values = _get(data, key, "", list, [] if default is _MISSING else default)
    return [parse(v, f"{key}[{i}]") for i, v in enumerate(values or [])]


@dataclass
class Manifest(Record):
    """A checkpoint's ``manifest.json`` (docs/checkpoints.md): kind (sharded, deduped, merged),
    the saving world size, the plan, every other file's record, every full tensor, the optimizer,
    the stored pieces and each saving rank's record."""

    kind: str
    world_size: int
    files: Dict[str, FileRecord]
    created: Optional[str] = None
    plan: Optional[List[ModulePlan]] = None
    merged_from: Optional[MergeSource] = None
    tensors: Dict[str, TensorInfo] = field(default_factory=dict)
    optimizer: Optional[OptimizerInfo] = None
    model: List[ModelPiece] = field(default_factory=list)
    optimizer_state: List[OptimizerPiece] = field(default_factory=list)
    ranks: List[RankRecord] = field(default_factory=list)
    format: str = FORMAT
    format_version: int = FORMAT_VERSION

    def to_json(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"format": self.format, "format_version": self.format_version, "kind": self.kind,
                               "world_size": self.world_size, "created": self.created,
                               "plan": None if self.plan is None else [p.to_json() for p in self.plan]}
        if self.merged_from is not None:
            out["merged_from"] = self.merged_from.to_json()
        out.update(files={n: r.to_json() for n, r in self.files.items()},
                   tensors={n: t.to_json() for n, t in self.tensors.items()},
                   optimizer=None if self.optimizer is None else self.optimizer.to_json(),
                   model=[r.to_json() for r in self.model],
                   optimizer_state=[r.to_json() for r in self.optimizer_state],
                   ranks=[r.to_json() for r in self.ranks])
        return out

    def dumps(self) -> bytes:
        """The bytes of ``manifest.json`` (JSON, indented by one, ASCII, a final newline)."""
        return (json.dumps(self.to_json(), indent=1, sort_keys=False) + "\n").encode("utf-8")

    @classmethod
    def loads(cls, raw: bytes, path: Optional[Path] = None) -> "Manifest":
        """The manifest in the bytes `raw` (of file `path`, named in errors), checked as `from_json`."""
        try:
            data = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{'the manifest' if path is None else path} is corrupt ({e}): restore it from a "
                                  f"copy, or use an earlier checkpoint") from None
        return cls.from_json(data, path)

    @classmethod
    def from_json(cls, data: Any, path: Optional[Path] = None) -> "Manifest":
        """The manifest read from file `path` (named in errors). Raises CheckpointError for a
        manifest of another format or version, or one that is corrupt (naming the field)."""
        where = "the manifest" if path is None else str(path)
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise CheckpointError(f"{where} is not an nnscaler checkpoint manifest (no \"format\": \"{FORMAT}\"): "
                                  f"pass a directory written by nnscaler.ckpt.save or merge")
        version = data.get("format_version")
        if version != FORMAT_VERSION:
            raise CheckpointError(f"{where} has format version {version!r}; this nnscaler-ckpt reads version "
                                  f"{FORMAT_VERSION}: install the nnscaler-ckpt that wrote it (or a newer one)")
        missing = [k for k in REQUIRED if k not in data]
        if missing:
            raise CheckpointError(f"{where} is corrupt (lacks {', '.join(missing)}): restore it from a copy, or use "
                                  f"an earlier checkpoint")
        try:
            kind = _get(data, "kind", "", str)
            if kind not in KINDS:
                raise RecordError(f"kind is {kind!r}, not one of {', '.join(KINDS)}")
            files = _get(data, "files", "", dict)
            tensors = _get(data, "tensors", "", dict, {}) or {}
            plan = _get(data, "plan", "", list, None)
            merged = _get(data, "merged_from", "", dict, None)
            optimizer = _get(data, "optimizer", "", dict, None)
            return cls(kind=kind, world_size=_get(data, "world_size", "", int),
                       files={n: FileRecord.from_json(r, f"files[{n!r}]") for n, r in files.items()},
                       created=_get(data, "created", "", str, None),
                       plan=None if plan is None else [ModulePlan.from_json(p, f"plan[{i}]") for i, p in
                                                       enumerate(plan)],
                       merged_from=None if merged is None else MergeSource.from_json(merged, "merged_from"),
                       tensors={n: TensorInfo.from_json(t, f"tensors[{n!r}]") for n, t in tensors.items()},
                       optimizer=None if optimizer is None else OptimizerInfo.from_json(optimizer, "optimizer"),
                       model=_items(data, "model", ModelPiece.from_json),
                       optimizer_state=_items(data, "optimizer_state", OptimizerPiece.from_json),
                       ranks=_items(data, "ranks", RankRecord.from_json))
        except RecordError as e:
            raise CheckpointError(f"{where} is corrupt ({e}): restore it from a copy, or use an earlier "
                                  f"checkpoint") from None
