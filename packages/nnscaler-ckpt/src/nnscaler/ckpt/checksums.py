"""The content checks of checkpoint files: the SHA-256 (the contract: what `verify` and
``nnscaler ckpt verify`` check) and a fast CRC-32 per 64 MiB chunk recorded beside it, both
computed while a file is written, each by its own helper thread.

``manifest.json`` records every file as ``{"size": n, "sha256": hex, "crc32": {"chunk": 67108864,
"values": [crc of bytes [0, chunk), [chunk, 2 chunk), ...]}}`` (manifests written before the CRC
existed lack ``crc32``; they are checked with the SHA-256). The CRC-32 runs at ~7 GB/s on one core
(SHA-256: ~2 GB/s) and its chunks are independent, so `load` and `merge` check it on every core.

Verification levels of `load(verify=...)` and `merge(verify=...)`:

* ``"fast"`` (the default): size, then the CRC-32 of every chunk (the SHA-256 when the manifest
  has no CRC). A mismatch is confirmed with the SHA-256, so a corrupted file is refused with the
  same "does not match its SHA-256" error as ``"sha256"`` gives.
* ``"sha256"`` (also ``True``): size and SHA-256, as `verify`.
* ``"size"`` (also ``False``): the size only.
"""
from __future__ import annotations

import functools
import hashlib
import os
import queue
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import List, Optional, Tuple, Union

from .errors import CheckpointError
from .records import Crc32, FileRecord

__all__ = ["CRC_CHUNK", "LEVELS", "verify_level", "Digests", "Piece", "crc32_combine", "crc32_chunks",
           "file_crc32_chunks", "bytes_record"]

CRC_CHUNK = 64 * 2**20
_WINDOW = 8 * 2**20  # bytes of a file read at a time by file_crc32_chunks
LEVELS = ("fast", "sha256", "size")
Level = Union[str, bool]


def verify_level(verify: Level) -> str:
    """``"fast"``, ``"sha256"`` or ``"size"`` from a level or a bool (True: SHA-256, False: size)."""
    if verify is True:
        return "sha256"
    if verify is False or verify is None:
        return "size"
    if verify in LEVELS:
        return verify
    raise CheckpointError(f"verify={verify!r}: pass one of {', '.join(map(repr, LEVELS))} (or True for "
                          f"'sha256', False for 'size')")


class _Pending:
    """Done when every helper thread has processed one fed buffer."""

    def __init__(self, count: int):
        self._left = count
        self._lock = threading.Lock()
        self._done = threading.Event()

    def release(self) -> None:
        with self._lock:
            self._left -= 1
            if self._left == 0:
                self._done.set()

    def wait(self) -> None:
        self._done.wait()


# CRC-32 of a concatenation from the CRC-32 of its parts (zlib's crc32_combine, which Python's
# zlib does not expose): multiplication modulo the CRC polynomial in GF(2), reflected.
_POLY = 0xEDB88320


def _multmodp(a: int, b: int) -> int:
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


_X2N = [1 << 30]  # x^(2^k) modulo the polynomial
for _ in range(31):
    _X2N.append(_multmodp(_X2N[-1], _X2N[-1]))


@functools.lru_cache(maxsize=256)
def _x8n(n: int) -> int:
    """x^(8 n) modulo the polynomial: appending n zero bytes."""
    p, k = 1 << 31, 3
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of A + B from the CRC-32 of A (`crc1`), of B (`crc2`) and the length of B."""
    return _multmodp(_x8n(len2), crc1) ^ crc2


Piece = Tuple[object, int, int, int]  # (what the bytes came from, offset there, length, their own CRC-32)


class Digests:
    """SHA-256 and chunked CRC-32 of the buffers given to `feed`, in order, each computed by its
    own helper thread (both release the GIL). A fed buffer must stay unchanged until the
    `_Pending` that `feed` returns is done; `finish` returns ``(sha256 hex, crc32 record)``.
    ``Digests(sha256=False)``: the CRC-32 only (one helper thread; `finish` gives ``None`` for
    the SHA-256). A buffer fed with a `tag` ``(source, offset)`` (bytes copied from another
    file) also gets its own CRC-32 in `pieces`, one per output chunk it falls into, computed in
    the same pass: the chunk CRC-32 of the output is combined from them (`crc32_combine`), and
    the source's can be (`merge_check`), so the copied bytes are read and CRC'd once."""

    def __init__(self, sha256: bool = True):
        self._sha = hashlib.sha256() if sha256 else None
        self._crcs: List[int] = []
        self._crc, self._crc_len = 0, 0
        self._error: Optional[BaseException] = None
        self.pieces: List[Piece] = []
        updates = [self._crc_update] + ([lambda view, tag: self._sha.update(view)] if sha256 else [])
        self._queues = [queue.SimpleQueue() for _ in updates]
        self._threads = [threading.Thread(target=self._run, args=(q, fn), daemon=True)
                         for q, fn in zip(self._queues, updates)]
        for t in self._threads:
            t.start()

    def feed(self, data, tag: Optional[Tuple[object, int]] = None) -> _Pending:
        view = memoryview(data).cast("B")
        pending = _Pending(len(self._queues))
        for q in self._queues:
            q.put((view, pending, tag))
        return pending

    def _run(self, q, update) -> None:
        while True:
            item = q.get()
            if item is None:
                return
            view, pending, tag = item
            del item
            try:
                if self._error is None:
                    update(view, tag)
            except BaseException as e:  # noqa: BLE001 - re-raised by finish()
                self._error = e
            finally:
                del view  # the buffer (a memory map) may be closed once released
                pending.release()

    def _crc_update(self, view: memoryview, tag: Optional[Tuple[object, int]]) -> None:
        done = 0
        while len(view):
            take = min(len(view), CRC_CHUNK - self._crc_len)
            if tag is None:
                self._crc = zlib.crc32(view[:take], self._crc)
            else:
                own = zlib.crc32(view[:take])
                self.pieces.append((tag[0], tag[1] + done, take, own))
                self._crc = crc32_combine(self._crc, own, take) if self._crc_len else own
            done += take
            self._crc_len += take
            view = view[take:]
            if self._crc_len == CRC_CHUNK:
                self._crcs.append(self._crc)
                self._crc, self._crc_len = 0, 0

    def finish(self) -> Tuple[Optional[str], Crc32]:
        for q in self._queues:
            q.put(None)
        for t in self._threads:
            t.join()
        if self._error is not None:
            raise self._error
        crcs = self._crcs + ([self._crc] if self._crc_len else [])
        return None if self._sha is None else self._sha.hexdigest(), Crc32(CRC_CHUNK, crcs)


def crc32_chunks(buffer, chunk: int = CRC_CHUNK, threads: Optional[int] = None) -> List[int]:
    """The CRC-32 of every `chunk` bytes of `buffer`, computed on `threads` threads (default:
    the cores this process may use)."""
    view = memoryview(buffer).cast("B")
    starts = range(0, len(view), chunk)
    threads = max(1, min(threads or _cores(), len(starts)))
    if threads == 1:
        return [zlib.crc32(view[s:s + chunk]) for s in starts]
    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(lambda s: zlib.crc32(view[s:s + chunk]), starts))


def file_crc32_chunks(path, size: int, chunk: int = CRC_CHUNK, threads: Optional[int] = None) -> List[int]:
    """`crc32_chunks` of file `path` (`size` bytes), read into one reused 8 MiB buffer per
    thread: resident memory stays at a buffer per thread."""
    def one(start: int, buffers: "queue.SimpleQueue") -> int:
        buf = buffers.get()
        try:
            crc = 0
            with open(path, "rb", buffering=0) as f:
                f.seek(start)
                left = min(chunk, size - start)
                while left:
                    n = f.readinto(buf[:min(len(buf), left)])
                    if not n:
                        raise OSError(f"{path}: unexpected end of file at {size - left}")
                    crc = zlib.crc32(buf[:n], crc)
                    left -= n
            return crc
        finally:
            buffers.put(buf)
    starts = range(0, size, chunk)
    threads = max(1, min(threads or _cores(), len(starts)))
    buffers: "queue.SimpleQueue" = queue.SimpleQueue()
    for _ in range(threads):
        buffers.put(memoryview(bytearray(min(_WINDOW, chunk, size))))
    if threads == 1:
        return [one(s, buffers) for s in starts]
    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(lambda s: one(s, buffers), starts))


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def bytes_record(data: bytes) -> FileRecord:
    """The manifest record of a small file holding `data`."""
    return FileRecord(len(data), hashlib.sha256(data).hexdigest(), Crc32(CRC_CHUNK, crc32_chunks(data, threads=1)))
