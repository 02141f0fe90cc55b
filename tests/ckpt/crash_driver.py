"""Run by test_save_crash.py in a fresh interpreter: SIGKILL two saving ranks at seeded points of a
save and check after each crash that the previous checkpoint verifies and loads.

Each crash point forks two ranks (gloo over TCP) that save a model with ``overwrite=True`` over the
checkpoint of the previous step; one of them SIGKILLs itself at its N-th file event (a write, an
fsync, a mkdir, a rename), the driver then SIGKILLs the other. Prints a JSON report."""
from __future__ import annotations

import json
import os
import random
import signal
import socket
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from crash_events import FileEvents  # noqa: E402
from fake_modules import FakeParallel  # noqa: E402

import nnscaler.ckpt as ckpt  # noqa: E402
from nnscaler.ckpt import safetensors_file  # noqa: E402

_TARGETS = ((os, "fsync"), (os, "rename"), (os, "replace"), (os, "mkdir"), (safetensors_file.SafetensorsWriter, "_emit"))


def _rank(rank, port, path, seed, kill_rank, kill_at, report_fd):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    events = FileEvents(kill_at if rank == kill_rank else 0, _TARGETS)
    ckpt.save(path, FakeParallel(seed=seed), overwrite=True,
              extra={"seed": seed})
    os.write(report_fd, json.dumps({"rank": rank, "events": events.count}).encode() + b"\n")
    dist.destroy_process_group()
    os._exit(0)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def save_in_two_ranks(path, seed, kill_rank=-1, kill_at=0, timeout=60.0):
    """Fork two ranks that save; returns (exit statuses, reports)."""
    port = _free_port()
    r, w = os.pipe()
    pids = []
    for rank in range(2):
        pid = os.fork()
        if pid == 0:
            os.close(r)
            try:
                _rank(rank, port, path, seed, kill_rank, kill_at, w)
            finally:
                os._exit(1)
        pids.append(pid)
    os.close(w)
    statuses, deadline = {}, time.monotonic() + timeout
    while len(statuses) < 2:
        for pid in pids:
            if pid not in statuses:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    statuses[pid] = status
        if kill_at and statuses and len(statuses) < 2:  # one rank died: the save is over for the other too
            for pid in pids:
                if pid not in statuses:
                    os.kill(pid, signal.SIGKILL)
                    statuses[pid] = os.waitpid(pid, 0)[1]
        if time.monotonic() > deadline:
            for pid in pids:
                if pid not in statuses:
                    os.kill(pid, signal.SIGKILL)
                    statuses[pid] = os.waitpid(pid, 0)[1]
        time.sleep(0.005)
    with os.fdopen(r) as f:
        reports = [json.loads(line) for line in f.read().splitlines()]
    return [statuses[p] for p in pids], reports


def main(root, npoints, seed):
    torch.set_num_threads(1)
    path = os.path.join(root, "ck")
    for _ in range(2):  # the previous checkpoint; the second save (over it) counts the events
        statuses, reports = save_in_two_ranks(path, seed=0)
        assert statuses == [0, 0], statuses
    events = {r["rank"]: r["events"] for r in reports}
    rng = random.Random(seed)
    candidates = [(r, n) for r in (0, 1) for n in range(1, events[r] + 1)]
    points = sorted(rng.sample(candidates, min(npoints, len(candidates))))  # distinct, spread over the save
    results = []
    previous = 0
    for i, (kill_rank, kill_at) in enumerate(points, 1):
        statuses, _ = save_in_two_ranks(path, seed=i, kill_rank=kill_rank, kill_at=kill_at)
        killed = any(os.WIFSIGNALED(s) and os.WTERMSIG(s) == signal.SIGKILL for s in statuses)
        ckpt.verify(path)
        pm = FakeParallel(seed=99)
        extra = ckpt.load(path, pm)
        found = extra["seed"]
        ok = found in (previous, i) and torch.equal(pm.fc_weight, FakeParallel(seed=found).fc_weight)
        leftovers = [n for n in os.listdir(root) if n != "ck"]
        for n in leftovers:  # a crashed save's staging directory: never taken for a checkpoint
            try:
                ckpt.load(os.path.join(root, n), pm)
                ok = False
            except ckpt.CheckpointError:
                pass
            import shutil
            shutil.rmtree(os.path.join(root, n))
        results.append({"point": [kill_rank, kill_at], "killed": killed, "loaded_seed": found, "ok": ok,
                        "leftovers": len(leftovers)})
        previous = found
    print(json.dumps({"events": events, "results": results}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
