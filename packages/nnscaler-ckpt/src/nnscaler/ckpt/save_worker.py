"""The background process of `async_save`: ``main([FD, SIZE, PARENT, THREADS, RESULTS_FD])`` in a
fresh interpreter, one per rank, persistent across saves. It maps the caller's shared memory
(file descriptor `FD`, `SIZE` bytes, inherited), reads one JSON `Job` per line on stdin, writes the
rank's file from the buffer, hashing as it writes, fsyncs, rank 0's worker commits, and it answers
one JSON line ``{"seq": n, "error": null | message}`` per job on `RESULTS_FD`. Nothing is pickled
and the caller's script is not imported again (as a ``spawn`` child would). No process group: the
ranks' workers coordinate through files in the staging directory, which is invisible to every
reader (``.<name>.writing-<token>/``):

* each worker, its file written and fsynced, writes ``.done-rank-0000r.json`` (its file records,
  or the error it met) into the staging directory;
* rank 0's worker waits for every rank's marker (at most `Job.timeout` seconds), removes them,
  writes the manifest and commits (`commit.StagingDir`); on any failure it deletes the staging
  directory;
* the other workers wait until the staging directory is gone: committed when the manifest at the
  destination lists their file with the SHA-256 they wrote (each file's metadata names its save,
  so no earlier file has it), failed otherwise (rank 0's error says why).

A kill at any moment (of a worker or of the training process: a worker exits with its parent)
leaves the previous checkpoint untouched and at most a staging directory, which nothing takes for
a checkpoint.
"""
from __future__ import annotations

import base64
import json
import mmap
import os
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

from nnscaler.ir import atomic_write

from .checksums import bytes_record
from .commit import StagingDir
from .errors import CheckpointError
from .names import MANIFEST
from .records import FileRecord, Manifest
from .rank_state import RankShare
from .replace_guard import check_save_destination
from .safetensors_file import write_record
from .save import fill_manifest

__all__ = ["Job", "main", "done_marker", "buffer_views"]

_POLL = 0.005  # seconds between looks at the staging directory
NICE = 10  # the worker's scheduling priority below training's: on busy cores training's steps go first


@dataclass
class Job:
    """One asynchronous save as a rank's worker gets it. `layout`: (key, dtype name, shape, byte
    offset) of every tensor in the shared buffer; rank 0 also gets the caller's small files, the
    manifest without files and pieces (JSON) and every rank's share (JSON)."""

    seq: int
    rank: int
    world: int
    dest: str
    token: str
    overwrite: bool
    file: str
    metadata: Dict[str, str]
    layout: List[Tuple[str, str, Tuple[int, ...], int]]
    timeout: float
    small: Dict[str, bytes] = field(default_factory=dict)
    manifest: Optional[Dict[str, Any]] = None
    shares: Optional[List[Dict[str, Any]]] = None

    def to_json(self) -> Dict[str, Any]:
        out = dict(self.__dict__)
        out["layout"] = [[k, d, list(s), o] for k, d, s, o in self.layout]
        out["small"] = {n: base64.b64encode(b).decode("ascii") for n, b in self.small.items()}
        return out

    @classmethod
    def from_json(cls, data: Dict[str, Any]) -> "Job":
        data = dict(data)
        data["layout"] = [(k, d, tuple(s), o) for k, d, s, o in data["layout"]]
        data["small"] = {n: base64.b64decode(b) for n, b in data["small"].items()}
        return cls(**data)


def done_marker(staging: Path, rank: int) -> Path:
    return staging / f".done-rank-{rank:05d}.json"


def buffer_views(buffer: torch.Tensor, layout) -> List[Tuple[str, torch.Tensor]]:
    """(key, tensor) of every tensor `layout` places in `buffer` (views, no copy)."""
    out = []
    for key, dtype, shape, offset in layout:
        dt = getattr(torch, dtype)
        n = torch.empty((), dtype=dt).element_size()
        for d in shape:
            n *= d
        out.append((key, buffer[offset:offset + n].view(dt).reshape(shape) if n else torch.empty(shape, dtype=dt)))
    return out


def _exit_with_parent(parent: int) -> None:
    """Exit within a fraction of a second of the training process (on Linux the kernel kills this
    process at once: `async_save.PROLOGUE` asked it to, before the imports)."""
    def watch() -> None:
        while True:
            if os.getppid() != parent:
                os._exit(1)
            time.sleep(0.2)
    if os.getppid() != parent:
        os._exit(1)
    threading.Thread(target=watch, daemon=True).start()


def main(argv: List[str]) -> None:
    """The worker's loop (see the module docstring); ends at the end of stdin."""
    fd, size, parent, threads, results_fd = map(int, argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops training, not a save being written
    _exit_with_parent(parent)
    try:
        os.nice(NICE)
    except OSError:  # not permitted here: same priority as training
        pass
    torch.set_num_threads(max(1, threads))
    buffer = torch.frombuffer(mmap.mmap(fd, size), dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)
    os.close(fd)
    results = os.fdopen(results_fd, "w", buffering=1)
    for line in sys.stdin:
        job = Job.from_json(json.loads(line))
        try:
            error = _save(job, buffer)
        except BaseException as e:  # noqa: BLE001 - reported to the caller's handle
            error = f"rank {job.rank}: {type(e).__name__}: {e}"
        results.write(json.dumps({"seq": job.seq, "error": error}) + "\n")


def _staging(job: Job) -> StagingDir:
    return StagingDir(job.dest, job.token, job.overwrite)


def _save(job: Job, buffer: torch.Tensor) -> Optional[str]:
    stage = _staging(job).path
    mark: Dict[str, Any]
    sha = None
    try:
        records = {job.file: write_record(stage / job.file, buffer_views(buffer, job.layout), job.metadata)}
        for name, data in job.small.items():
            with open(stage / name, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            records[name] = bytes_record(data)
        mark = {"records": {n: r.to_json() for n, r in records.items()}}
        sha = records[job.file].sha256
    except OSError as e:
        mark = {"error": f"rank {job.rank} could not write {stage / job.file} ({e}); the previous checkpoint is "
                         f"intact"}
    except Exception as e:  # noqa: BLE001 - every rank must learn of it
        mark = {"error": f"rank {job.rank}: {type(e).__name__}: {e}"}
    try:
        atomic_write(done_marker(stage, job.rank), json.dumps(mark))
    except OSError as e:
        error = mark.get("error") or f"rank {job.rank} could not write to {stage} ({e}); the previous checkpoint " \
                                     f"is intact"
        return _fail(stage, error) if job.rank == 0 else error
    if job.rank == 0:
        return _commit(job, stage)
    return mark.get("error") or _await_commit(job, stage, sha)


def _await_commit(job: Job, stage: Path, sha: str) -> Optional[str]:
    """Rank > 0: None once rank 0's worker committed this save, else the error."""
    deadline = time.monotonic() + job.timeout
    while stage.exists():
        if time.monotonic() > deadline:
            return (f"rank 0 did not commit {job.dest} within {job.timeout:g} s (its process may have died); the "
                    f"previous checkpoint is intact; delete {stage}")
        time.sleep(_POLL)
    try:
        committed = json.loads((Path(job.dest) / MANIFEST).read_text("utf-8"))["files"][job.file]["sha256"] == sha
    except (OSError, ValueError, KeyError, TypeError):
        committed = False
    return None if committed else (f"rank 0 did not commit {job.dest} (its error says why); the previous checkpoint "
                                   f"is intact")


def _commit(job: Job, stage: Path) -> Optional[str]:
    """Rank 0: wait for every rank's file, then commit; the error every rank reports, or None."""
    deadline = time.monotonic() + job.timeout
    markers: Dict[int, Dict[str, Any]] = {}
    error: Optional[str] = None
    while len(markers) < job.world:
        for r in range(job.world):
            if r not in markers and done_marker(stage, r).is_file():
                try:
                    markers[r] = json.loads(done_marker(stage, r).read_text("utf-8"))
                except (OSError, ValueError) as e:
                    markers[r] = {"error": f"rank {r}'s marker in {stage} is unreadable ({e})"}
        if len(markers) < job.world:
            if time.monotonic() > deadline:
                late = [r for r in range(job.world) if r not in markers]
                error = (f"rank{'s' if len(late) > 1 else ''} {', '.join(map(str, late))} did not write "
                         f"{'their files' if len(late) > 1 else 'its file'} of {job.dest} within {job.timeout:g} s "
                         f"(a save process may have died); the previous checkpoint is intact")
                break
            time.sleep(_POLL)
    if error is None:
        error = next((m["error"] for _, m in sorted(markers.items()) if "error" in m), None)
    if error is None:
        try:
            manifest = _manifest(job, markers)
            for r in range(job.world):
                done_marker(stage, r).unlink()
            check_save_destination(Path(job.dest), job.overwrite)  # still safe to replace
            _staging(job).commit(manifest)
            return None
        except (CheckpointError, OSError) as e:
            error = str(e) if isinstance(e, CheckpointError) else (f"{job.dest}: the commit failed ({e}); the "
                                                                   f"previous checkpoint is intact")
    return _fail(stage, error)


def _fail(stage: Path, error: str) -> str:
    """Rank 0: delete the staging directory (the other ranks' workers then find no commit)."""
    shutil.rmtree(stage, ignore_errors=True)
    return error


def _manifest(job: Job, markers: Dict[int, Dict[str, Any]]) -> Manifest:
    records = {n: FileRecord.from_json(r, n) for _, m in sorted(markers.items()) for n, r in m["records"].items()}
    return fill_manifest(Manifest.from_json(job.manifest), [RankShare.from_json(s) for s in job.shares], records,
                         list(job.small))
