"""Writing the files of a merge (and of `convert`): reading, checking, hashing and writing overlap.

Each tensor is either copied as byte ranges of the source files (`SafetensorsWriter.copy`: the
kernel copies, the writer's helper threads hash the same bytes, and their CRC-32 also serves the
sources' check, `merge_check`), or assembled in slabs of rows (`slabs`) that a helper thread reads
a couple ahead of the writing (`ReadAhead`), or, where only the whole tensor can be rebuilt (ZeRO
ranges of a tensor split along another dim than the first), built whole by the writer and written
before the next is built. Memory therefore holds a few slabs, or one tensor, never two. A finished
file is hashed and fsynced while the next is written (the writeback has been running all along,
`writeback`), at most two at a time.
"""
from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from .checksums import Piece
from .read_ahead import ReadAhead
from .records import FileRecord
from .safetensors_file import SafetensorsWriter, dtype_name

__all__ = ["Item", "Whole", "slabs", "write_files", "SLAB"]

Item = Tuple[str, Tuple[int, ...], str, int]  # (name in the file, shape, dtype name, bytes)
Segments = Sequence[Tuple[str, int, int]]  # (source path, offset, length) whose concatenation is a tensor
SLAB = 16 * 2**20  # bytes of a tensor assembled (read) at a time
AHEAD = 2  # slabs read ahead of the one being written
_META = {"format": "pt"}


@dataclass
class Whole:
    """A tensor that can only be built whole: `make()` builds it, in the writer's thread."""

    make: Callable[[], torch.Tensor]


def _itemsize(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


def slabs(read: Callable[[tuple], torch.Tensor], shape: Tuple[int, ...], dtype: str) -> Iterator[torch.Tensor]:
    """The values of a tensor as slabs of whole rows of at most `SLAB` bytes, `read(region)` each."""
    if not shape:
        yield read(())
        return
    row = math.prod(shape[1:]) * _itemsize(dtype)
    step = max(1, SLAB // max(row, 1))
    rest = tuple((0, d) for d in shape[1:])
    for r0 in range(0, shape[0], step):
        yield read(((r0, min(r0 + step, shape[0])), *rest))


def write_files(stage, files: List[Tuple[str, List[Item]]], values: Callable[[Item], Union[Iterable[torch.Tensor],
                                                                                         Whole]],
                segments: Dict[str, Segments], done: List[int], total: int,
                progress: Optional[Callable[[int, int, str], None]]) -> Tuple[Dict[str, FileRecord], List[Piece]]:
    """Write `files` ((file name, its tensors) in order) into `stage`: tensor ``name`` is copied
    from ``segments[name]`` when there, else written from ``values(item)`` (its slabs, or a
    `Whole`). Returns (file records, the CRC-32 pieces of the copied bytes)."""
    records: Dict[str, FileRecord] = {}
    pieces: List[Piece] = []
    closing: List[tuple] = []  # (file name, writer, future of its close): hashed while the next is written

    def produce():
        for _, items in files:
            for item in items:
                if item[0] in segments:
                    yield "copy", segments[item[0]]
                    continue
                got = values(item)
                if isinstance(got, Whole):
                    yield "whole", got.make
                    continue
                for part in got:
                    yield "part", part
                yield "end", None

    def take(first: torch.Tensor, stream) -> Iterator[torch.Tensor]:
        """`first`, then the parts up to the tensor's end (a plain loop: closing this generator
        must not close `stream`, as ``yield from`` would)."""
        yield first
        for kind, part in stream:
            if kind == "end":
                return
            yield part
    with ThreadPoolExecutor(1) as closer, ReadAhead(produce, AHEAD) as ahead:
        stream = iter(ahead)
        try:
            for fname, items in files:
                writer = SafetensorsWriter(stage.file(fname), [(n, dtype_name(getattr(torch, d)), s)
                                                               for n, s, d, _ in items], _META,
                                           inflight_bytes=SLAB * AHEAD)
                try:
                    for name, _, _, nbytes in items:
                        kind, payload = next(stream)
                        if kind == "copy":
                            writer.copy(name, payload)
                        elif kind == "whole":
                            value = payload()
                            writer.write_parts(name, [value])
                            writer.drain()  # the next whole tensor is built only once this one is hashed
                            del value
                        elif kind == "end":  # no rows
                            writer.write_parts(name, [])
                        else:
                            writer.write_parts(name, take(payload, stream))
                        done[0] += nbytes
                        if progress:
                            progress(done[0], total, name)
                except BaseException:
                    writer.abort()
                    raise
                if closing:  # at most two files hashing at a time
                    closing[-1][2].result()
                closing.append((fname, writer, closer.submit(writer.close)))
            for fname, writer, future in closing:
                future.result()
                records[fname] = writer.record
                pieces.extend(writer.pieces)
        except BaseException:
            for _, writer, future in closing:
                if future.exception() is not None:
                    writer.abort()
            raise
    return records, pieces
