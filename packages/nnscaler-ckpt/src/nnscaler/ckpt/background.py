"""The background process of `async_save` as its training process sees it: the shared-memory
buffer the state is copied into (kept across saves while it is large enough; pinned when the
tensors live on CUDA), the process (`save_worker`, a fresh interpreter mapping that buffer, started
at the first save and kept), the plans given to it and the handles its answers finish. One
instance lives in the in-flight owner (`inflight.OWNER.background`)."""
from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
import tempfile
import threading
import weakref
from pathlib import Path
from typing import Dict, Optional, Tuple

import torch

from .handle import AsyncSave
from .plan import SavePlan

__all__ = ["BackgroundProcess"]


class BackgroundProcess:
    """``proc``: the process (None before the first save); ``buffer``: the shared buffer (a uint8
    tensor, or None); ``buffers_made``: buffers allocated so far; ``prepared``: weak references to
    the (module, optimizer) `prepare_async_save` last sized the buffer for (None: not prepared)."""

    def __init__(self):
        self.forget()

    def forget(self) -> None:
        """Hold nothing (a forked child: the parent's process, buffer and handles stay the parent's)."""
        self.proc: Optional[subprocess.Popen] = None
        self.pending: Dict[int, AsyncSave] = {}
        self.buffer: Optional[torch.Tensor] = None
        self._map: Optional[mmap.mmap] = None
        self._fd: Optional[int] = None
        self.pinned = False
        self.pin_failed = False  # pinning was asked for and refused: the pageable buffer serves as it is
        self.seq = 0
        self.buffers_made = 0
        self.prepared: Optional[Tuple[weakref.ref, Optional[weakref.ref]]] = None

    def ensure_buffer(self, nbytes: int, pin: bool, *, touch: bool = False) -> torch.Tensor:
        """A shared buffer of at least `nbytes`: the kept one when it is large enough. `touch`: a
        new buffer has every page written once now (the first copy into fresh shared memory
        otherwise pays a page fault per page: ~20x the copy of the later saves)."""
        if (self.buffer is not None and self.buffer.numel() >= nbytes
                and (self.pinned or self.pin_failed or not pin)):
            return self.buffer
        self.stop()  # a process maps the buffer it was started with
        self.release_buffer()
        if hasattr(os, "memfd_create"):
            fd = os.memfd_create("nnscaler-ckpt-save")
        else:
            with tempfile.TemporaryFile() as f:
                fd = os.dup(f.fileno())
        os.ftruncate(fd, max(nbytes, 1))
        self._fd, self._map = fd, mmap.mmap(fd, max(nbytes, 1))
        self.buffer = torch.frombuffer(self._map, dtype=torch.uint8)
        if touch:
            self.buffer.zero_()
        if pin and torch.cuda.is_available():  # pinned: the copies from the GPU run at full speed
            error = torch.cuda.cudart().cudaHostRegister(self.buffer.data_ptr(), self.buffer.numel(), 0)
            self.pinned = int(getattr(error, "value", error)) == 0  # else pageable: slower, as correct
        self.pin_failed = pin and not self.pinned
        self.buffers_made += 1
        return self.buffer

    def release_buffer(self) -> None:
        """Free the shared buffer (its process, if any, is stopped first by the callers)."""
        if self.buffer is not None and self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.buffer.data_ptr())
        self.buffer, self.pinned, self.pin_failed, self.prepared = None, False, False, None
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a view is still alive somewhere: the garbage collector unmaps it
                pass
            self._map = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def prepared_for(self, module, optimizer) -> bool:
        """Whether `prepare_async_save` sized the current buffer for this very module and optimizer."""
        if self.prepared is None or self.buffer is None:
            return False
        m, o = self.prepared
        return m() is module and (o() if o is not None else None) is optimizer

    def mark_prepared(self, module, optimizer) -> None:
        self.prepared = (weakref.ref(module), weakref.ref(optimizer) if optimizer is not None else None)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, script: str) -> None:
        """The process running `script` (``python -c``; arguments: buffer fd, buffer size, this
        process's pid, threads, answers fd), started when there is none (or it died)."""
        if self.running():
            return
        read, write = os.pipe()
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", script, str(self._fd), str(self.buffer.numel()), str(os.getpid()), "1", str(write)],
            stdin=subprocess.PIPE, pass_fds=(self._fd, write), env=env, text=True)
        os.close(write)
        self.pending = {}
        threading.Thread(target=self._read_answers, args=(self.proc, self.pending, read), daemon=True,
                         name="nnscaler-ckpt-save-results").start()

    @staticmethod
    def _read_answers(proc: subprocess.Popen, pending: Dict[int, AsyncSave], fd: int) -> None:
        with os.fdopen(fd) as answers:
            for line in answers:
                answer = json.loads(line)
                handle = pending.pop(answer["seq"], None)
                if handle is not None:
                    handle.finish(answer["error"])
        code = proc.wait()
        for handle in list(pending.values()):  # the process died: what it was given is lost
            handle.finish(f"the background save process of this rank exited (code {code}) before {handle.path} "
                           f"was committed; the previous checkpoint is intact")
        pending.clear()

    def submit(self, plan: SavePlan) -> AsyncSave:
        """Give `plan` to the process (its tensors are in the buffer); the handle its answer finishes."""
        self.seq += 1
        path = Path(plan.dest)
        handle = AsyncSave(path)
        self.pending[self.seq] = handle
        try:
            self.proc.stdin.write(json.dumps({"seq": self.seq, "plan": plan.to_json()}) + "\n")
            self.proc.stdin.flush()
        except OSError as e:
            self.pending.pop(self.seq, None)
            handle.finish(f"the background save process of this rank is gone ({e}); {path} was not written; the "
                           f"previous checkpoint is intact")
        return handle

    def stop(self) -> None:
        """End the process (it finishes what it was given first)."""
        proc, self.proc = self.proc, None
        if proc is not None:
            try:
                proc.stdin.close()
            except OSError:
                pass
            proc.wait()
