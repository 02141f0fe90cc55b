"""The pieces a checkpoint holds, indexed by full tensor name, and reading them.

Works the same for every kind: a sharded or deduped checkpoint lists each rank's pieces, a merged
one holds whole tensors. Files are opened lazily with ``safetensors.safe_open`` (memory-mapped:
only the bytes of the slices asked for are read) after their size and contents were checked
against the manifest at the level asked for (`checksums`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from safetensors import safe_open

from .checksums import Level
from .errors import CheckpointError
from .records import Manifest, ModelPiece, OptimizerPiece
from .safetensors_file import dtype_of, read_header
from .verify import check_file, read_checked

__all__ = ["Sources"]

Region = Tuple[Tuple[int, int], ...]
Piece = Union[ModelPiece, OptimizerPiece]


class Sources:
    """`model[full_name]` and `optim[(full_name, state)]`: the manifest's piece records."""

    def __init__(self, root, manifest: Manifest, verify: Level = True, prefer_rank: Optional[int] = None,
                 whole_files: Sequence[str] = ()):
        self.root = Path(root)
        self.manifest = manifest
        self.verify = verify
        self.prefer_rank = prefer_rank
        self.model: Dict[str, List[ModelPiece]] = {}
        self.optim: Dict[Tuple[str, str], List[OptimizerPiece]] = {}
        for rec in manifest.model:
            self.model.setdefault(rec.full_name, []).append(rec)
        for rec in manifest.optimizer_state:
            self.optim.setdefault((rec.full_name, rec.state), []).append(rec)
        for recs in (*self.model.values(), *self.optim.values()):
            recs.sort(key=lambda r: (r.rank != prefer_rank, r.rank or 0))  # own file first
        self._open: Dict[str, Any] = {}
        self._headers: Dict[str, dict] = {}
        self._data_start: Dict[str, int] = {}
        self._whole = set(whole_files)  # mapped at once and checked (a rank's own file)
        self._buffers: Dict[str, torch.Tensor] = {}

    def handle(self, file: str):
        if file not in self._open:
            record = self.manifest.files.get(file)
            if record is None:
                raise CheckpointError(f"{self.root / 'manifest.json'} names {file} for a tensor but does not list it "
                                      f"among its files: the manifest is corrupt; use an earlier checkpoint")
            if file in self._whole:
                self._buffers[file] = read_checked(self.root, file, record, self.verify)
            else:
                check_file(self.root, file, record, hash_=self.verify)
            try:
                self._open[file] = safe_open(str(self.root / file), framework="pt")
            except Exception as e:  # safetensors raises its own error types
                raise CheckpointError(f"{self.root / file} cannot be read as safetensors ({e}): copy the file back "
                                      f"or use an earlier checkpoint") from None
        return self._open[file]

    def read(self, rec: Piece, region: Optional[Region] = None) -> torch.Tensor:
        """Piece `rec` (or `region` of it, in the piece's own coordinates)."""
        return self.read_key(rec.file, rec.key, region)

    def read_key(self, file: str, key: str, region: Optional[Region] = None) -> torch.Tensor:
        """Tensor `key` of `file` (or `region` of it). A whole tensor is read with plain file reads
        (no memory map that would stay resident), a region through ``safe_open``'s memory map
        (only its bytes are touched)."""
        f = self.handle(file)
        try:
            if file in self._buffers:  # a view of the file read at once
                code, shape, (begin, end) = self._entry(file, key)
                start = self._data_start[file]
                raw = self._buffers[file][start + begin:start + end]
                if (start + begin) % torch.empty((), dtype=dtype_of(code)).element_size():
                    raw = raw.clone()  # safetensors does not align tensors: an unaligned view cannot be typed
                value = raw.view(dtype_of(code)).reshape(shape) if end > begin else \
                    torch.empty(shape, dtype=dtype_of(code))
                return value if region is None or len(region) == 0 else value[tuple(slice(a, b) for a, b in region)]
            if region is None or len(region) == 0:
                code, shape, (begin, end) = self._entry(file, key)
                out = torch.empty(shape, dtype=dtype_of(code))
                if end > begin:
                    with open(self.root / file, "rb") as fh:
                        fh.seek(self._data_start[file] + begin)
                        fh.readinto(memoryview(out.view(-1).view(torch.uint8).numpy()).cast("B"))
                return out
            return f.get_slice(key)[tuple(slice(a, b) for a, b in region)]
        except Exception as e:
            raise CheckpointError(f"{self.root / file}: tensor {key!r} cannot be read ({e}): copy the "
                                  f"file back or use an earlier checkpoint") from None

    def _entry(self, file: str, key: str):
        if file not in self._headers:
            header = read_header(self.root / file)
            self._headers[file] = header
            with open(self.root / file, "rb") as fh:
                self._data_start[file] = 8 + int.from_bytes(fh.read(8), "little")
        e = self._headers[file][key]
        return e["dtype"], tuple(e["shape"]), tuple(e["data_offsets"])

    def byte_range(self, rec: Piece) -> Tuple[str, int, int]:
        """(path, offset, length) of piece `rec`'s bytes in its file (checked first, as `read`)."""
        self.handle(rec.file)
        _, _, (begin, end) = self._entry(rec.file, rec.key)
        return str(self.root / rec.file), self._data_start[rec.file] + begin, end - begin

    def keys(self, file: str) -> List[str]:
        return list(self.handle(file).keys())

    def close(self) -> None:
        self._open.clear()
        self._buffers.clear()

    def __enter__(self) -> "Sources":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
