"""Run by test_save_crash.py in a fresh interpreter: SIGKILL two saving ranks at seeded points of a
save and check after each crash that the previous checkpoint verifies and loads.

Each crash point forks two ranks (gloo over TCP) that save a model with ``overwrite=True`` over the
checkpoint of the previous step; one of them SIGKILLs itself at its N-th file event (a write, an
fsync, a mkdir, a rename), the driver then SIGKILLs the other. Prints a JSON report."""
from __future__ import annotations

import importlib
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


def _fork_two(target, *args):
    """Fork ranks 0 and 1 running ``target(rank, port, *args, report_fd)``; returns (pids, the
    reports' read end). A rank's exception is printed; a rank always ends with os._exit."""
    port = _free_port()
    r, w = os.pipe()
    pids = []
    for rank in range(2):
        pid = os.fork()
        if pid == 0:
            os.close(r)
            try:
                target(rank, port, *args, w)
            except BaseException:  # noqa: BLE001 - shown in the driver's output
                import traceback
                traceback.print_exc()
            finally:
                os._exit(1)
        pids.append(pid)
    os.close(w)
    return pids, r


def save_in_two_ranks(path, seed, kill_rank=-1, kill_at=0, timeout=60.0):
    """Fork two ranks that save; returns (exit statuses, reports)."""
    pids, r = _fork_two(_rank, path, seed, kill_rank, kill_at)
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


# -- asynchronous saves: the background processes are killed at their file events, or the ranks
# (and with them their background processes) at moments of the save -------------------------------

_HERE = os.path.dirname(os.path.abspath(__file__))
_WORKER_WITH_EVENTS = (  # async_save's worker, counting its file events and SIGKILLing itself at one
    f"import atexit; sys.path.insert(0, {_HERE!r}); from crash_events import FileEvents; "
    "from nnscaler.ckpt import safetensors_file; "
    "ev = FileEvents(int(os.environ['CRASH_KILL_AT']), ((os, 'fsync'), (os, 'rename'), (os, 'replace'), "
    "(os, 'mkdir'), (safetensors_file.SafetensorsWriter, '_emit'))); "
    "atexit.register(lambda: open(os.environ['CRASH_EVENTS'], 'w').write(str(ev.count))); "
    "from nnscaler.ckpt.save_worker import main; main(sys.argv[1:])")
ASYNC_TIMEOUT = 3.0  # how long a background process waits for another's files once one was killed


def _async_rank(rank, port, path, seed, kill_rank, kill_at, report_fd):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), CRASH_KILL_AT=str(kill_at if rank == kill_rank
                                                                                         else 0),
                      CRASH_EVENTS=os.path.join(os.path.dirname(path), f".events-{rank}"))
    import torch.distributed as dist
    async_module = importlib.import_module("nnscaler.ckpt.async_save")  # the module, not the package's function
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    async_module._WORKER = async_module.PROLOGUE + _WORKER_WITH_EVENTS
    module = FakeParallel(seed=seed)  # deduped: rank 0 stores the model, both ranks their RNG states
    handle = ckpt.async_save(path, module, kind="deduped", overwrite=True, extra={"seed": seed},
                             timeout=ASYNC_TIMEOUT if kill_at else 600)
    os.write(report_fd, json.dumps({"rank": rank, "worker": async_module._SAVER.proc.pid}).encode() + b"\n")
    with torch.no_grad():  # training goes on: the checkpoint holds the state at the call
        module.fc_weight.mul_(0)
    try:
        handle.wait()
        error = None
    except ckpt.CheckpointError as e:
        error = str(e)
    committed = os.path.isfile(os.path.join(path, "manifest.json"))
    async_module._SAVER.stop()
    os.write(report_fd, json.dumps({"rank": rank, "error": error, "committed": committed}).encode() + b"\n")
    dist.destroy_process_group()
    os._exit(0)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" in f.read()  # a zombie nobody reaps here: dead all the same
    except FileNotFoundError:
        return True


def async_in_two_ranks(root, path, seed, kill_rank=-1, kill_at=0, kill_ranks_after=None, timeout=90.0):
    """Fork two ranks that save asynchronously; their background processes SIGKILL themselves at
    event `kill_at` of rank `kill_rank`, or both ranks are SIGKILLed `kill_ranks_after` seconds after
    their calls returned. Returns (reports, events per rank, background processes left alive)."""
    for r in (0, 1):
        if os.path.exists(os.path.join(root, f".events-{r}")):
            os.unlink(os.path.join(root, f".events-{r}"))
    pids, r = _fork_two(_async_rank, path, seed, kill_rank, kill_at)
    reports, buf, deadline, killed = [], b"", time.monotonic() + timeout, False
    os.set_blocking(r, False)
    alive = set(pids)
    while alive and time.monotonic() < deadline:
        try:
            buf += os.read(r, 65536)
        except BlockingIOError:
            pass
        *lines, buf = buf.split(b"\n")
        reports += [json.loads(line) for line in lines if line]
        for pid in list(alive):
            if os.waitpid(pid, os.WNOHANG)[0]:
                alive.discard(pid)
        if kill_ranks_after is not None and not killed and sum("worker" in x for x in reports) == 2:
            time.sleep(kill_ranks_after)
            for pid in alive:
                os.kill(pid, signal.SIGKILL)
            killed = True
        time.sleep(0.005)
    for pid in alive:  # the deadline passed
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    try:
        while True:
            more = os.read(r, 65536)
            if not more:
                break
            buf += more
    except BlockingIOError:
        pass
    reports += [json.loads(line) for line in buf.split(b"\n") if line]
    os.close(r)
    workers = [x["worker"] for x in reports if "worker" in x]
    end = time.monotonic() + 5
    while not all(_gone(p) for p in workers) and time.monotonic() < end:
        time.sleep(0.05)
    events = {}
    for rank in (0, 1):
        f = os.path.join(root, f".events-{rank}")
        if os.path.exists(f):
            with open(f) as fh:
                events[rank] = int(fh.read())
            os.unlink(f)
    return reports, events, [p for p in workers if not _gone(p)]


def _check(root, path, previous, i, pm):
    ckpt.verify(path)
    found = ckpt.load(path, pm)["seed"]
    ok = found in (previous, i) and torch.equal(pm.fc_weight, FakeParallel(seed=found).fc_weight)
    leftovers = [n for n in os.listdir(root) if n != "ck"]
    for n in leftovers:  # staging directories (and outcome files): never taken for a checkpoint
        try:
            ckpt.load(os.path.join(root, n), pm)
            ok = False
        except ckpt.CheckpointError:
            pass
        import shutil
        shutil.rmtree(os.path.join(root, n)) if os.path.isdir(os.path.join(root, n)) else \
            os.unlink(os.path.join(root, n))
    return found, ok, len(leftovers)


def main_async(root, npoints, seed):
    torch.set_num_threads(1)
    path = os.path.join(root, "ck")
    reports, counted, _ = async_in_two_ranks(root, path, seed=0)  # the previous checkpoint; counts the events
    assert [(x["error"], x["committed"]) for x in reports if "error" in x] == [(None, True)] * 2, reports
    found, ok, leftovers = _check(root, path, 0, 0, FakeParallel(seed=99))
    assert ok and not leftovers, (found, leftovers)  # the state at the call, nothing left beside it
    rng = random.Random(seed)
    candidates = [(r, n) for r in (0, 1) for n in range(1, counted[r] + 1)]
    points = [("worker", p) for p in sorted(rng.sample(candidates, min(npoints, len(candidates))))]
    points += [("ranks", 0.0), ("ranks", 0.3)]  # the training processes die: their background ones with them
    results, previous = [], 0
    for i, (what, point) in enumerate(points, 1):
        if what == "worker":
            reports, events, left = async_in_two_ranks(root, path, seed=i, kill_rank=point[0], kill_at=point[1])
            killed = point[0] not in events  # a killed background process never wrote its count
        else:
            reports, events, left = async_in_two_ranks(root, path, seed=i, kill_ranks_after=point)
            killed = not any("error" in x for x in reports)
        found, ok, leftovers = _check(root, path, previous, i, FakeParallel(seed=99))
        results.append({"what": what, "point": point, "killed": killed, "loaded_seed": found, "ok": ok,
                        "leftovers": leftovers, "alive_after": left,
                        "errors": [x["error"] for x in reports if x.get("error")]})
        previous = found
    print(json.dumps({"events": counted, "results": results}))


if __name__ == "__main__":
    (main_async if sys.argv[4:] == ["async"] else main)(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
