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

import hashlib
import os
import queue
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import List, Optional, Tuple, Union

from .errors import CheckpointError
from .records import Crc32, FileRecord

__all__ = ["CRC_CHUNK", "LEVELS", "verify_level", "Digests", "crc32_chunks", "file_crc32_chunks", "bytes_record"]

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


class Digests:
    """SHA-256 and chunked CRC-32 of the buffers given to `feed`, in order, each computed by its
    own helper thread (both release the GIL). A fed buffer must stay unchanged until the
    `_Pending` that `feed` returns is done; `finish` returns ``(sha256 hex, crc32 record)``.
    ``Digests(sha256=False)``: the CRC-32 only (one helper thread; `finish` gives ``None`` for
    the SHA-256)."""

    def __init__(self, sha256: bool = True):
        self._sha = hashlib.sha256() if sha256 else None
        self._crcs: List[int] = []
        self._crc, self._crc_len = 0, 0
        self._error: Optional[BaseException] = None
        updates = [self._crc_update] + ([self._sha.update] if sha256 else [])
        self._queues = [queue.SimpleQueue() for _ in updates]
        self._threads = [threading.Thread(target=self._run, args=(q, fn), daemon=True)
                         for q, fn in zip(self._queues, updates)]
        for t in self._threads:
            t.start()

    def feed(self, data) -> _Pending:
        view = memoryview(data).cast("B")
        pending = _Pending(len(self._queues))
        for q in self._queues:
            q.put((view, pending))
        return pending

    def _run(self, q, update) -> None:
        while True:
            item = q.get()
            if item is None:
                return
            view, pending = item
            del item
            try:
                if self._error is None:
                    update(view)
            except BaseException as e:  # noqa: BLE001 - re-raised by finish()
                self._error = e
            finally:
                del view  # the buffer (a memory map) may be closed once released
                pending.release()

    def _crc_update(self, view: memoryview) -> None:
        while len(view):
            take = min(len(view), CRC_CHUNK - self._crc_len)
            self._crc = zlib.crc32(view[:take], self._crc)
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
