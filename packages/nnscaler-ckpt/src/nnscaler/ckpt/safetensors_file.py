"""Writing safetensors files one tensor at a time, hashing the bytes as they are written.

The format (https://github.com/huggingface/safetensors): an 8-byte little-endian header length,
a JSON header ``{name: {dtype, shape, data_offsets}, "__metadata__": {str: str}}`` padded with
spaces to a multiple of 8, then the tensors' bytes back to back. Writing it here instead of
``safetensors.torch.save_file`` lets a merge stream (one tensor in memory at a time) and gives the
SHA-256 and the chunked CRC-32 (`checksums`) without reading the file again. Files are read
with ``safetensors.safe_open``.
"""
from __future__ import annotations

import collections
import json
import mmap
import os
import struct
from pathlib import Path
from typing import Deque, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch

from .checksums import Digests, Piece
from .records import FileRecord
from .writeback import start_writeback

__all__ = ["DTYPES", "dtype_name", "dtype_of", "TensorSpec", "SafetensorsWriter", "write_tensors",
           "write_record", "read_header", "tensor_bytes"]

DTYPES: Dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.complex64: "C64",
}
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"), ("uint16", "U16"),
                     ("uint32", "U32"), ("uint64", "U64")):
    if hasattr(torch, _name):
        DTYPES[getattr(torch, _name)] = _code
_BY_CODE = {code: dtype for dtype, code in DTYPES.items()}

TensorSpec = Tuple[str, str, Tuple[int, ...]]  # (name, dtype code, shape)
_CHUNK = 16 * 2**20  # bytes written (and hashed, overlapped) at a time
_INFLIGHT = 4  # memory-mapped source windows written but not yet hashed, at most
_INFLIGHT_BYTES = 1 << 30  # bytes of the caller's tensors written but not yet hashed, at most


def dtype_name(dtype: torch.dtype) -> str:
    """The safetensors code of a torch dtype (``F32``)."""
    try:
        return DTYPES[dtype]
    except KeyError:
        raise TypeError(f"dtype {dtype} cannot be stored in safetensors") from None


def dtype_of(code: str) -> torch.dtype:
    return _BY_CODE[code]


def _itemsize(code: str) -> int:
    return torch.empty((), dtype=_BY_CODE[code]).element_size()


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of `t` (CPU, row-major), without a copy when it is contiguous."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


class SafetensorsWriter:
    """``w = SafetensorsWriter(path, specs, metadata)``, then ``w.write(name, tensor)`` (or
    ``w.write_parts`` / ``w.copy``) for every spec in order, then ``size, sha256 = w.close()``
    (flushed and fsynced; ``w.record`` is then the file's manifest record: size, SHA-256, chunked
    CRC-32). The bytes are hashed by helper threads (`checksums.Digests`) while they are written:
    writing runs ahead of the hashing (up to `inflight_bytes` of the caller's tensors, 4 windows of
    copied files), the writeback to disk is started as each chunk is written (`writeback`) and the
    fsync overlaps the hashing of the tail, so a file takes about max(write, SHA-256), not their
    sum. ``sha256=False``: the CRC-32 only (``record.sha256`` is None). Bytes copied from other
    files (`copy`) get their own CRC-32 in ``w.pieces`` (`Digests`)."""

    def __init__(self, path, specs: Sequence[TensorSpec], metadata: Optional[Mapping[str, str]] = None,
                 sha256: bool = True, inflight_bytes: int = _INFLIGHT_BYTES):
        self.path = Path(path)
        self._specs = list(specs)
        self._next = 0
        header: Dict[str, object] = {"__metadata__": dict(metadata or {})}
        offset = 0
        for name, code, shape in self._specs:
            n = _itemsize(code)
            for d in shape:
                n *= int(d)
            header[name] = {"dtype": code, "shape": [int(d) for d in shape], "data_offsets": [offset, offset + n]}
            offset += n
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-len(raw) % 8)
        self.record: Optional[FileRecord] = None
        self.pieces: List[Piece] = []
        self._digests: Optional[Digests] = Digests(sha256)
        self._inflight_limit = inflight_bytes
        self._inflight: Deque[tuple] = collections.deque()  # (pending, bytes, what to release once hashed)
        self._inflight_bytes = 0
        self._windows = 0
        self._file = open(self.path, "wb", buffering=0)  # large writes: no Python buffer in between
        self._size = 0
        self._emit(struct.pack("<Q", len(raw)) + raw)

    def _track(self, pending, nbytes: int, *hold) -> None:
        self._inflight.append((pending, nbytes, hold))
        self._inflight_bytes += nbytes
        self._windows += bool(hold)
        while self._windows > _INFLIGHT or self._inflight_bytes > self._inflight_limit:
            self._retire()

    def _retire(self) -> None:
        pending, nbytes, hold = self._inflight.popleft()
        self._inflight_bytes -= nbytes
        self._windows -= bool(hold)
        pending.wait()
        for h in hold:  # memory maps of source windows, their views first
            try:
                if isinstance(h, memoryview):
                    h.release()
                elif isinstance(h, mmap.mmap):
                    h.close()
            except BufferError:  # still exported somewhere: the garbage collector unmaps it
                pass

    def drain(self) -> None:
        """Wait until every byte written so far is hashed (then the caller's tensors are free)."""
        while self._inflight:
            self._retire()

    def _emit(self, data) -> None:
        """Write `data` while the helper threads hash it, chunk by chunk."""
        view = memoryview(data).cast("B")
        for start in range(0, len(view), _CHUNK):
            chunk = view[start:start + _CHUNK]
            self._track(self._digests.feed(chunk), len(chunk))
            _write_all(self._file, chunk)
            start_writeback(self._file.fileno(), self._size, len(chunk))
            self._size += len(chunk)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        expected, code, shape = self._specs[self._next]
        if name != expected or tuple(tensor.shape) != tuple(shape) or dtype_name(tensor.dtype) != code:
            raise ValueError(f"{self.path.name}: expected {expected} {code}{list(shape)}, got {name} "
                             f"{dtype_name(tensor.dtype)}{list(tensor.shape)}")
        self._emit(tensor_bytes(tensor))
        self._next += 1

    def write_parts(self, name: str, parts: Iterable[torch.Tensor]) -> None:
        """Write tensor `name` as the concatenation of the bytes of `parts` (e.g. its rows in slabs,
        produced while the previous ones are written); each part is kept until it is hashed."""
        expected, code, shape = self._specs[self._next]
        n, written = _itemsize(code), 0
        for d in shape:
            n *= int(d)
        if name != expected:
            raise ValueError(f"{self.path.name}: expected {expected}, got {name}")
        for part in parts:
            if dtype_name(part.dtype) != code:
                raise ValueError(f"{self.path.name}: {name} is {code}, a part of it is {dtype_name(part.dtype)}")
            data = tensor_bytes(part)
            written += len(data)
            self._emit(data)
        if written != n:
            raise ValueError(f"{self.path.name}: expected {expected} of {n} bytes, got {written}")
        self._next += 1

    def copy(self, name: str, segments: Sequence[Tuple[str, int, int]]) -> None:
        """Write tensor `name` as the concatenation of byte ranges ``(file, offset, length)`` of
        other files, copied by the kernel (``os.copy_file_range``) while the helper threads hash
        the same bytes through a memory map of each window (no copy in user space)."""
        expected, code, shape = self._specs[self._next]
        n = _itemsize(code)
        for d in shape:
            n *= int(d)
        if name != expected or sum(s[2] for s in segments) != n:
            raise ValueError(f"{self.path.name}: expected {expected} of {n} bytes, got {name} of "
                             f"{sum(s[2] for s in segments)}")
        out = self._file.fileno()
        for path, offset, length in segments:
            with open(path, "rb", buffering=0) as src:
                start = offset
                while start < offset + length:  # windows end at multiples of _CHUNK of the source
                    size = min(_CHUNK - start % _CHUNK, offset + length - start)
                    base = start - start % mmap.ALLOCATIONGRANULARITY
                    window = mmap.mmap(src.fileno(), start + size - base, access=mmap.ACCESS_READ, offset=base)
                    view = memoryview(window)[start - base:]
                    if len(view) != size:
                        raise OSError(f"{path}: unexpected end of file at {start + len(view)}")
                    self._track(self._digests.feed(view, (path, start)), size, view, window)
                    done = 0
                    while done < size:
                        try:
                            moved = os.copy_file_range(src.fileno(), out, size - done, start + done)
                        except (AttributeError, OSError):  # no kernel copy here: write from the map
                            moved = self._file.write(view[done:])
                        if moved == 0:
                            raise OSError(f"{path}: unexpected end of file at {start + done}")
                        done += moved
                    start_writeback(out, self._size, size)
                    self._size += size
                    start += size
        self._next += 1

    def close(self) -> Tuple[int, str]:
        """Flush, fsync and close; returns (size in bytes, SHA-256 hex) and sets `record`."""
        if self._next != len(self._specs):
            self.abort()
            raise ValueError(f"{self.path.name}: {len(self._specs) - self._next} tensors were not written")
        self._file.flush()
        try:
            os.fsync(self._file.fileno())  # the helper threads hash the tail meanwhile
        except BaseException:
            self.abort()
            raise
        self.drain()
        digest, crc = self._digests.finish()
        self.pieces = self._digests.pieces
        self._digests = None
        self._file.close()
        self.record = FileRecord(self._size, digest, crc)
        return self._size, digest

    def abort(self) -> None:
        self.drain()
        if self._digests is not None:
            try:
                self._digests.finish()
            except BaseException:  # noqa: BLE001 - aborting already
                pass
            self._digests = None
        if not self._file.closed:
            self._file.close()


def _write_all(f, chunk: memoryview) -> None:
    while chunk:  # a raw write may take part of the chunk
        chunk = chunk[f.write(chunk):]


def write_record(path, tensors: Iterable[Tuple[str, torch.Tensor]],
                 metadata: Optional[Mapping[str, str]] = None, *, sha256: bool = True) -> FileRecord:
    """Write (name, tensor) pairs to a safetensors file; returns its manifest record (without the
    SHA-256 when `sha256` is False: size and CRC-32 only)."""
    items = list(tensors)
    writer = SafetensorsWriter(path, [(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in items], metadata,
                               sha256)
    try:
        for name, t in items:
            writer.write(name, t)
    except BaseException:
        writer.abort()
        raise
    writer.close()
    return writer.record


def write_tensors(path, tensors: Iterable[Tuple[str, torch.Tensor]],
                  metadata: Optional[Mapping[str, str]] = None) -> Tuple[int, str]:
    """Write (name, tensor) pairs to a safetensors file; returns (size, SHA-256)."""
    record = write_record(path, tensors, metadata)
    return record.size, record.sha256


def read_header(path) -> Dict[str, dict]:
    """The JSON header of a safetensors file (raises ValueError when it is not one)."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError("shorter than a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > 100 * 2**20:
            raise ValueError(f"header length {n} is implausible")
        raw = f.read(n)
        if len(raw) != n:
            raise ValueError("the header is cut off")
    return json.loads(raw)
