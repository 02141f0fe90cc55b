"""`async_save`: a checkpoint written in the background while training goes on.

The call does in the caller what needs the process group and is cheap (what `save` agrees on:
errors, the deduped pieces, the staging directory, every rank's records to rank 0), copies this
rank's tensors into a shared-memory buffer kept for the next saves (pinned when the tensors are on
CUDA), and returns an `AsyncSave` handle. Writing, hashing, fsync and rank 0's commit happen in
this rank's background process (`save_worker`), which uses no process group. At most one save is
in flight per process: the next `async_save` or `save` first waits for it.
"""
from __future__ import annotations

import atexit
import json
import mmap
import os
import subprocess
import sys
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

import torch

from nnscaler.ir import NnScalerWarning

from .collectives import all_gather_json
from .module_tensors import with_whole_tensors
from .errors import CheckpointError, describe
from . import after_commit
from .inflight import set_in_flight, wait_in_flight
from .save import prepare
from .save_worker import Job

__all__ = ["async_save", "AsyncSave", "AsyncSaveWarning", "stop_async_saves", "DEFAULT_TIMEOUT"]

_ALIGN = 64  # byte alignment of each tensor in the buffer
DEFAULT_TIMEOUT = 600.0  # seconds the ranks' background processes wait for each other's files
# the worker's first lines, before its imports (seconds): it dies with this process (Linux), or
# exits when this process is already gone; then the worker proper (`save_worker.main`)
PROLOGUE = ("import os, sys\nif sys.platform.startswith('linux'):\n    import ctypes, signal\n"
            "    ctypes.CDLL('libc.so.6').prctl(1, signal.SIGKILL)\n"
            "if os.getppid() != int(sys.argv[3]):\n    os._exit(1)\n")
_WORKER = PROLOGUE + "from nnscaler.ckpt.save_worker import main\nmain(sys.argv[1:])\n"


class AsyncSaveWarning(NnScalerWarning):
    """An asynchronous save failed and nobody called its handle's ``wait()``."""


class AsyncSave:
    """The handle of one `async_save`: ``done()`` tells whether it finished, ``wait()`` blocks until
    it is committed and returns its path, or raises the CheckpointError it met (on every call)."""

    def __init__(self, path: Path):
        self.path = path
        self._finished = threading.Event()
        self._error: Optional[str] = None
        self._observed = False

    def _finish(self, error: Optional[str]) -> None:
        if not self._finished.is_set():
            self._error = error
            self._finished.set()

    def done(self) -> bool:
        """True once the save is committed or has failed (never blocks)."""
        return self._finished.is_set()

    def wait(self, timeout: Optional[float] = None) -> Path:
        """Block until the checkpoint is committed (at most `timeout` seconds, then a
        CheckpointError); returns its path. Raises the save's error if it failed."""
        if not self._finished.wait(timeout):
            raise CheckpointError(f"{self.path}: the asynchronous save is still being written after {timeout:g} s; "
                                  f"wait longer (or call wait() without a timeout)")
        self._observed = True
        if self._error:
            raise CheckpointError(self._error)
        return self.path

    def join(self) -> None:
        """Wait without raising; warn (`AsyncSaveWarning`) when it failed and nobody waited for it."""
        self._finished.wait()
        if self._error and not self._observed:
            self._observed = True
            warnings.warn(f"the asynchronous save to {self.path} failed: {self._error}", AsyncSaveWarning,
                          stacklevel=4)


class _Saver:
    """This process's background worker, its shared buffer (kept across saves) and the handles of
    the jobs it was given."""

    def __init__(self):
        self.proc: Optional[subprocess.Popen] = None
        self.pending: Dict[int, AsyncSave] = {}
        self.buffer: Optional[torch.Tensor] = None
        self._map: Optional[mmap.mmap] = None
        self._fd: Optional[int] = None
        self.pinned = False
        self.seq = 0
        self.buffers_made = 0  # buffers allocated so far (one is reused while the state keeps its size)

    def ensure_buffer(self, nbytes: int, pin: bool) -> torch.Tensor:
        """A shared buffer of at least `nbytes`: the kept one when it is large enough."""
        if self.buffer is not None and self.buffer.numel() >= nbytes and (self.pinned or not pin):
            return self.buffer
        self.stop()  # a worker maps the buffer it was started with
        self._release_buffer()
        if hasattr(os, "memfd_create"):
            fd = os.memfd_create("nnscaler-ckpt-save")
        else:
            with tempfile.TemporaryFile() as f:
                fd = os.dup(f.fileno())
        os.ftruncate(fd, max(nbytes, 1))
        self._fd, self._map = fd, mmap.mmap(fd, max(nbytes, 1))
        self.buffer = torch.frombuffer(self._map, dtype=torch.uint8)
        if pin and torch.cuda.is_available():  # pinned: the copies from the GPU run at full speed
            error = torch.cuda.cudart().cudaHostRegister(self.buffer.data_ptr(), self.buffer.numel(), 0)
            self.pinned = int(getattr(error, "value", error)) == 0  # else pageable: slower, as correct
        self.buffers_made += 1
        return self.buffer

    def _release_buffer(self) -> None:
        if self.buffer is not None and self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.buffer.data_ptr())
        self.buffer, self.pinned = None, False
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a view is still alive somewhere: the garbage collector unmaps it
                pass
            self._map = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def start(self) -> None:
        """The worker, started when there is none (or it died)."""
        if self.proc is not None and self.proc.poll() is None:
            return
        read, write = os.pipe()
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _WORKER, str(self._fd), str(self.buffer.numel()),
             str(os.getpid()), "1", str(write)], stdin=subprocess.PIPE, pass_fds=(self._fd, write), env=env,
            text=True)
        os.close(write)
        self.pending = {}
        threading.Thread(target=self._read_results, args=(self.proc, self.pending, read), daemon=True,
                         name="nnscaler-ckpt-save-results").start()

    @staticmethod
    def _read_results(proc: subprocess.Popen, pending: Dict[int, AsyncSave], fd: int) -> None:
        with os.fdopen(fd) as results:
            for line in results:
                answer = json.loads(line)
                handle = pending.pop(answer["seq"], None)
                if handle is not None:
                    handle._finish(answer["error"])
        code = proc.wait()
        for handle in list(pending.values()):  # the worker died: what it was given is lost
            handle._finish(f"the background save process of this rank exited (code {code}) before {handle.path} "
                           f"was committed; the previous checkpoint is intact")
        pending.clear()

    def submit(self, job: Job, path: Path) -> AsyncSave:
        handle = AsyncSave(path)
        self.pending[job.seq] = handle
        try:
            self.proc.stdin.write(json.dumps(job.to_json()) + "\n")
            self.proc.stdin.flush()
        except OSError as e:
            self.pending.pop(job.seq, None)
            handle._finish(f"the background save process of this rank is gone ({e}); {path} was not written; the "
                           f"previous checkpoint is intact")
        return handle

    def stop(self) -> None:
        """End the worker (it finishes what it was given first)."""
        proc, self.proc = self.proc, None
        if proc is not None:
            try:
                proc.stdin.close()
            except OSError:
                pass
            proc.wait()


_SAVER = _Saver()


def _forget_in_child() -> None:
    """A forked child (a data loader's worker) has no background process of its own."""
    _SAVER.__init__()  # the parent's worker, buffer and handles stay the parent's
    set_in_flight(None)


os.register_at_fork(after_in_child=_forget_in_child)


@atexit.register
def stop_async_saves() -> None:
    """Wait for this process's save in flight, then end its background save process (the next
    `async_save` starts a new one). Also runs at exit."""
    wait_in_flight()
    after_commit.wait()
    _SAVER.stop()


def _layout(tensors: List[Tuple[str, torch.Tensor]]) -> Tuple[List[Tuple[str, str, Tuple[int, ...], int]], int]:
    layout, offset = [], 0
    for key, t in tensors:
        layout.append((key, str(t.dtype).replace("torch.", ""), tuple(t.shape), offset))
        offset += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    return layout, offset


def _copy_into(buffer: torch.Tensor, tensors, layout) -> None:
    cuda = False
    with torch.no_grad():
        for (_, t), (_, _, shape, offset) in zip(tensors, layout):
            n = t.numel() * t.element_size()
            if n:
                dst = buffer[offset:offset + n].view(t.dtype).reshape(shape)
                dst.copy_(t.detach(), non_blocking=t.is_cuda)
                cuda = cuda or t.is_cuda
    if cuda:
        torch.cuda.synchronize()


@with_whole_tensors(writeback=False)
def async_save(path, module: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *,
               kind: str = "sharded", extra: Optional[Dict[str, Any]] = None, overwrite: bool = False,
               files: Optional[Mapping[str, Union[bytes, str]]] = None,
               timeout: float = DEFAULT_TIMEOUT) -> AsyncSave:
    """`save`, written in the background: COLLECTIVE like `save` (same arguments); returns once
    this rank's state is copied (training may then change it), with a handle whose ``wait()``
    returns once the checkpoint is committed (or raises its error) and ``done()`` tells whether it
    finished. `timeout`: seconds the ranks' background processes wait for each other's files."""
    wait_in_flight()
    after_commit.wait()
    p = prepare(path, module, optimizer, kind=kind, extra=extra, overwrite=overwrite, files=files)
    error: Optional[str] = None
    layout: list = []
    try:
        layout, nbytes = _layout(p.tensors)
        pin = any(t.is_cuda for _, t in p.tensors)
        buffer = _SAVER.ensure_buffer(nbytes, pin)
        _copy_into(buffer, p.tensors, layout)
        _SAVER.start()
    except Exception as e:  # noqa: BLE001 - every rank must learn of it
        error = describe(e, p.rank)
    gathered = all_gather_json({"share": p.share.to_json(), "error": error})
    failed = [g["error"] for g in gathered if g["error"]]
    if failed:
        if p.rank == 0:
            p.staging.discard()
        raise CheckpointError(failed[0])
    _SAVER.seq += 1
    job = Job(seq=_SAVER.seq, rank=p.rank, world=p.world, dest=str(p.dest), token=p.staging.token,
              overwrite=p.overwrite, file=p.file, metadata={**p.metadata, "nnscaler_save": p.staging.token},
              layout=layout, timeout=float(timeout),
              small=p.small, manifest=p.manifest.to_json() if p.manifest is not None else None,
              shares=[g["share"] for g in gathered] if p.rank == 0 else None)
    handle = _SAVER.submit(job, p.dest)
    set_in_flight(handle)
    return handle
