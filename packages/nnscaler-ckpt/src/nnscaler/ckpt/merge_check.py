"""Checking a merge's source files while they are merged, reading each byte once.

The bytes a merge copies from a source file (`SafetensorsWriter.copy`) get their own CRC-32 from
the writer's helper thread as they are copied (`checksums.Digests`, ``writer.pieces``); the rest
of each source file (its header, the tensors assembled in memory, RNG states, the optimizer's
state) is CRC'd here, by a helper thread, while the merge runs. At the end each chunk's CRC-32 is
combined from its parts (`checksums.crc32_combine`) and compared with the manifest: the CRC-32 of
the copied bytes serves the output's record and the source's check alike. A chunk whose parts do
not tile it exactly is CRC'd from the file instead. Where the level asks for more (``"sha256"``
with a recorded SHA-256, or a manifest without CRC-32), each file is checked whole in the helper
thread (`verify.check_file`). A mismatch is confirmed with the SHA-256 and reported with
`verify`'s errors, so a corrupted source is refused with the same words at every level.
"""
from __future__ import annotations

import bisect
import mmap
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from .checksums import Piece, crc32_combine
from .errors import CheckpointError
from .records import FileRecord, Manifest
from .verify import check_file, crc_mismatch, crc_uses

__all__ = ["SourceCheck"]

Part = Tuple[int, int, int]  # (offset, length, CRC-32 of those bytes)


def _uncovered(size: int, ranges: Sequence[Tuple[int, int]]) -> List[Tuple[int, int]]:
    """[start, stop) of the bytes of [0, size) that no (offset, length) range covers."""
    out, pos = [], 0
    for offset, length in sorted(ranges):
        if offset > pos:
            out.append((pos, min(offset, size)))
        pos = max(pos, offset + length)
    if pos < size:
        out.append((pos, size))
    return [(a, b) for a, b in out if b > a]


def _crc_range(view: memoryview, start: int, stop: int) -> int:
    return zlib.crc32(view[start:stop])


class SourceCheck:
    """Checks the files of `manifest` at `root` at `level`; `copied`: file name -> the byte ranges
    (offset, length) the merge will copy from it (CRC'd by the writer). Started at once; `finish`
    (with the writer's pieces) raises the first mismatch, `explain` names a bad source after a
    failed merge, `close` waits for the helper thread."""

    def __init__(self, root: Path, manifest: Manifest, level: str, copied: Mapping[str, Sequence[Tuple[int, int]]]):
        self.root = root
        self.level = level
        self._records: Dict[str, FileRecord] = dict(manifest.files)
        self._combined = [n for n, r in self._records.items() if copied.get(n) and crc_uses(r, level)]
        self._copied = {n: list(copied[n]) for n in self._combined}
        self._gaps: Dict[str, List[Part]] = {}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="nnscaler-ckpt-source-check")
        self._future = self._pool.submit(self._run)

    def _run(self) -> None:
        for name, record in self._records.items():
            if name not in self._combined:
                check_file(self.root, name, record, self.level)
                continue
            check_file(self.root, name, record, "size")
            chunk, parts = record.crc32.chunk, []
            with self._mapped(name) as view:
                for lo, stop in _uncovered(record.size, self._copied[name]):
                    while lo < stop:  # split at the chunks' boundaries
                        hi = min(stop, (lo // chunk + 1) * chunk)
                        parts.append((lo, hi - lo, _crc_range(view, lo, hi)))
                        lo = hi
            self._gaps[name] = parts

    def _mapped(self, name: str):
        return _Mapped(self.root / name)

    def finish(self, pieces: Iterable[Piece]) -> None:
        """Raise CheckpointError for the first source that fails its check; `pieces`: the CRC-32
        of the copied bytes, as the writers computed them."""
        self._future.result()
        by_path: Dict[str, List[Part]] = {}
        for source, offset, length, crc in pieces:
            by_path.setdefault(str(source), []).append((offset, length, crc))
        for name in self._combined:
            path, record = self.root / name, self._records[name]
            parts = sorted(by_path.get(str(path), []) + self._gaps[name])
            if self._chunks(name, record, parts) != list(record.crc32.values):
                raise crc_mismatch(path, record)

    def _chunks(self, name: str, record: FileRecord, parts: List[Part]) -> List[int]:
        chunk, size, out = record.crc32.chunk, record.size, []
        starts = [p[0] for p in parts]
        with self._mapped(name) as view:
            for lo in range(0, size, chunk):
                hi = min(lo + chunk, size)
                inside = parts[bisect.bisect_left(starts, lo):bisect.bisect_left(starts, hi)]
                pos, crc = lo, 0
                for offset, length, own in inside:
                    if offset != pos or offset + length > hi:
                        break  # a hole, an overlap, or a part across the boundary: read it
                    crc = crc32_combine(crc, own, length) if pos > lo else own
                    pos += length
                out.append(crc if pos == hi else _crc_range(view, lo, hi))
        return out

    def explain(self) -> Optional[CheckpointError]:
        """After a failed merge: the error of a source that is missing, truncated or corrupt (which
        explains the failure better than its effect), or None when every source passes."""
        error = self._future.exception()
        if error is not None:
            return error if isinstance(error, CheckpointError) else None
        for name in self._combined:
            try:
                check_file(self.root, name, self._records[name], self.level)
            except CheckpointError as e:
                return e
        return None

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class _Mapped:
    """``with _Mapped(path) as view``: the file's bytes, memory-mapped (empty for an empty file)."""

    def __init__(self, path: Path):
        self._file = open(path, "rb")
        size = self._file.seek(0, 2)
        self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ) if size else None
        self._view = memoryview(self._map) if size else memoryview(b"")

    def __enter__(self) -> memoryview:
        return self._view

    def __exit__(self, *exc) -> None:
        self._view.release()
        if self._map is not None:
            self._map.close()
        self._file.close()
