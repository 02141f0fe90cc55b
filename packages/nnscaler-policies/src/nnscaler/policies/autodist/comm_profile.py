"""Measure the backend's collectives: latency and bandwidth per collective and group size.

`measured_comm_model(sizes, device, world=P)` returns a `CommModel` for groups of the given
sizes in a job of P local processes, from ``<cache>/autodist/comm-<device>.json`` when it holds
them, else by starting local processes (gloo on CPU, NCCL on CUDA) that time what each
collective adds to a running program at five message sizes, 16 KiB to 16 MiB (`_in_program`); the
model reads times off these points (`CommModel`), and a least-squares line ``latency + wire_bytes /
bandwidth`` is kept beside them. A group of n < P is measured as the job runs it: P processes in
P / n groups, all of them working and communicating at once (key ``"n/P"``); 4 processes on 2
cores ran a 2-stage x 2 data-parallel GPT's gradient sync and output broadcasts in 15 ms where
pairs measured alone priced 4. The result is cached; ``re_profile`` measures again (so does a
cache of an older format).
"""
from __future__ import annotations

import json
import os
import socket
import statistics
import time
from pathlib import Path
from typing import Dict, Iterable, Optional, Tuple

import torch

from nnscaler.ir import COST_MODELS, atomic_write

from .comm_model import COLLECTIVES, CommModel, DEFAULT_PROFILE, profile_key
from .op_profile import cache_dir, device_key
from .progress import task

__all__ = ["measured_comm_model", "measure"]

_SIZES = (1 << 14, 1 << 18, 1 << 20, 1 << 22, 1 << 24)  # full tensor bytes: latency- to bandwidth-bound
_FORMAT = 6  # in-program costs (`_in_program`), p2p with the receive posted ahead, CPU shares
_WORK_MATMULS = 16  # the work before each collective of a chain (about 0.7 ms on one CPU core)
_CHAIN = 6  # collectives per timed chain
_REPEATS = 5  # timed chains of each kind per size (after one warm-up)
_JOB_VARS = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE",
             "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK"}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, backend: str, n: int, out_dir: str) -> None:
    """One of `world` processes, in world / n groups of n consecutive ranks, each group timing the
    collectives at once; rank 0 writes its group's points.

    It makes its process group and sub-groups itself rather than through `nnscaler.runtime.grid`
    (the owner of a job's groups): nnscaler.policies may not import the runtime, and these are
    throw-away processes whose default group is destroyed at the end, taking every group along."""
    import torch.distributed as dist
    torch.set_num_threads(1)
    device = f"cuda:{rank}" if backend == "nccl" else "cpu"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        groups = [dist.new_group(list(range(b, b + n))) for b in range(0, world, n)]  # every rank creates each
        base = rank - rank % n
        group = groups[rank // n]
        result: Dict[str, list] = {}
        work = torch.randn(128, 128, device=device)
        for coll in COLLECTIVES:
            points, shares = [], []
            for full in _SIZES:
                elems = max(n, full // 4 // n * n)
                x = torch.ones(elems, device=device)
                seconds, share = _in_program(dist, coll, x, n, rank - base, base, group, work, backend)
                wire = elems * 4 if coll == "p2p" else COST_MODELS["ring"](coll, elems * 4, n)
                points.append((wire, seconds))
                shares.append(share)
            result[coll] = [*_fit(points), [list(p) for p in points], statistics.median(shares)]
        if rank == 0:
            Path(out_dir, "comm.json").write_text(json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _in_program(dist, coll: str, x, n: int, rank: int, base: int, group, work, backend: str) -> Tuple[float, float]:
    """(Seconds one `coll` on `x` adds to a running program, the share of a bare collective's time
    its process spends on a CPU: gloo's threads copy, reduce and hand messages over; 0 on NCCL).
    The seconds: a chain of (a short work, the
    collective) timed against the same work alone, the medians' difference, and at least the
    fastest chain of the collective alone. Right after a barrier a collective is cheaper than in
    a program: there the ranks arrive apart, a rank that waited has to be woken, and on an
    oversubscribed CPU the others' work takes its core (2 cores: a 16 KiB all-gather over 2
    ranks, 0.2 ms after a barrier, 0.8 ms in a chain). A point-to-point message goes as the
    pipeline runtime sends it, its receive posted before the work: a blocking send and receive
    waited for the sender's gloo thread, 3.2 ms for 16 KiB with 4 processes on 2 cores. The CPU
    share is the process's CPU time (all its threads) over the bare chains' time, averaged over
    the group."""
    def chain(with_work: bool, with_coll: bool) -> float:
        dist.barrier(group=group)
        t = time.perf_counter()
        sends = []
        for _ in range(_CHAIN):
            # a point-to-point message as the pipeline runtime sends it: the receive posted before
            # the work, the send not waited for (runtime/pipeline/p2p.py)
            recv = dist.irecv(x, base, group=group) if with_coll and coll == "p2p" and rank == 1 else None
            if with_work:
                for _ in range(_WORK_MATMULS):
                    work @ work
            if with_coll and coll == "p2p":
                if rank == 0:
                    sends.append(dist.isend(x, base + 1, group=group))
                elif recv is not None:
                    recv.wait()
            elif with_coll:
                _run(dist, coll, x, n, group)
            if backend == "nccl":
                torch.cuda.synchronize()
        for req in sends:
            req.wait()
        return (time.perf_counter() - t) / _CHAIN

    chain(True, True)  # warm-up
    both, alone, bare = [], [], []
    cpu = 0.0
    for _ in range(_REPEATS):
        both.append(chain(True, True))
        alone.append(chain(True, False))
        c = time.process_time()
        bare.append(chain(False, True))
        cpu += time.process_time() - c
    share = min(1.0, cpu / _CHAIN / max(sum(bare), 1e-12)) if backend == "gloo" else 0.0
    mine = torch.tensor([statistics.median(both) - statistics.median(alone), min(bare)], dtype=torch.float64,
                        device=x.device)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=group)  # the program goes at the slowest rank's pace
    shared = torch.tensor([share], dtype=torch.float64, device=x.device)
    dist.all_reduce(shared, group=group)
    cost, floor = (float(v) for v in mine.cpu())
    return max(cost, floor), float(shared) / n


def _fit(points):
    """(latency s, bytes/s) of ``time = latency + wire / bandwidth``, least squares over the
    (wire bytes, median seconds) points. Two points alone made a noisy small-message time
    (a shared machine) into a latency of milliseconds and a bandwidth of tens of GB/s; a
    non-increasing fit falls back to the smallest time as latency and the largest message's
    rate as bandwidth."""
    xs = [b for b, _ in points]
    ys = [t for _, t in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    if slope <= 0:
        return max(min(ys), 1e-7), max(xs) / max(max(ys), 1e-9)
    lat = my - slope * mx
    if lat < 1e-7:  # through the smallest point's time instead of a negative latency
        lat = max(min(ys), 1e-7) * 0.5
        slope = max((y - lat) / x for x, y in zip(xs, ys))
    return lat, 1.0 / slope


def _run(dist, coll, x, n, group):
    """Collective `coll` on `x` in `group` of `n` ranks."""
    if coll == "all_reduce":
        dist.all_reduce(x, group=group)
    elif coll == "all_gather":
        chunk = x[: x.numel() // n].clone()
        dist.all_gather_into_tensor(x, chunk, group=group)
    elif coll == "reduce_scatter":
        out = torch.empty(x.numel() // n, device=x.device)
        dist.reduce_scatter_tensor(out, x, group=group)
    else:  # all_to_all (p2p is timed in `_in_program`, its receive posted ahead)
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)


def measure(sizes: Iterable[int], device: str = "cpu", timeout: float = 300.0, world: Optional[int] = None) -> dict:
    """Measure every collective on groups of `sizes`: a group of n alone on n local processes,
    or, in a job of `world` > n local processes (a multiple of n), world / n such groups at once
    (`profile_key`). Not a group of n beside world - n idle processes: those took CPU from it
    (5x a lone pair's time for 256 KiB on 2 cores).

    The processes run this module (``python -m``), not the user's script, so nothing of the
    user's program is re-executed."""
    sizes = sorted({int(s) for s in sizes if s > 1})
    backend = "nccl" if device.startswith("cuda") else "gloo"
    collectives: Dict[str, Dict[str, list]] = {}
    with task("collectives", len(sizes)) as progress:
        for n in sizes:
            key = profile_key(n, world)
            procs = world if "/" in key else n
            progress.advance(f"{backend} collectives on groups of {n} ({procs} processes)")
            got = _measure_world(procs, n, backend, timeout)
            for coll, entry in got.items():
                collectives.setdefault(coll, {})[key] = entry
    return {"backend": backend, "format": _FORMAT, "collectives": collectives}


def _measure_world(world: int, n: int, backend: str, timeout: float) -> dict:
    import subprocess
    import sys
    import tempfile
    port = _port()
    # A clean environment: inside torchrun (or a launcher) the variables of the running job
    # (RANK, MASTER_PORT, TORCHELASTIC_USE_AGENT_STORE, ...) must not reach the measuring group.
    env = {k: v for k, v in os.environ.items()
           if k not in _JOB_VARS and not k.startswith(("TORCHELASTIC_", "TORCH_ELASTIC_"))}
    with tempfile.TemporaryDirectory() as tmp:
        procs = [subprocess.Popen([sys.executable, "-m", __name__, str(rank), str(world), str(port), backend,
                                   str(n), tmp],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
                 for rank in range(world)]
        errors = []
        for p in procs:
            try:
                _, err = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                _, err = p.communicate()
            if p.returncode:
                errors.append(err.decode(errors="replace")[-2000:])
        if errors:
            raise RuntimeError(f"autodist: measuring {backend} collectives on {world} local processes (groups of "
                               f"{n}) failed "
                               f"(pass pas_config['_comm_profile'] to skip measuring):\n{errors[0]}")
        return json.loads(Path(tmp, "comm.json").read_text())


def measured_comm_model(sizes: Iterable[int], device: str = "cpu", re_profile: bool = False,
                        given: dict = None, world: Optional[int] = None, load: float = 1.0) -> CommModel:
    """A CommModel for groups of `sizes` in a job of `world` local processes whose compute runs
    `load` times slower than a process alone (`CommModel.load`): `given` profile, else cached,
    else measured now."""
    if given is not None:
        return CommModel(given, world=world or 0, load=load)
    sizes = sorted({int(s) for s in sizes if s > 1})
    if not sizes:
        return CommModel(DEFAULT_PROFILE, load=load)
    path = cache_dir() / "autodist" / f"comm-{device_key(device)}.json"
    cached = {}
    if path.is_file() and not re_profile:
        try:
            cached = json.loads(path.read_text())
        except (OSError, ValueError):
            cached = {}
    if cached.get("format") != _FORMAT:
        cached = {}
    have = cached.get("collectives", {}).get("all_reduce", {})
    missing = [s for s in sizes if profile_key(s, world) not in have]
    if missing or not cached:
        fresh = measure(missing or sizes, device, world=world)
        merged = cached.get("collectives", {}) if cached else {}
        for coll, table in fresh["collectives"].items():
            merged.setdefault(coll, {}).update(table)
        cached = {"backend": fresh["backend"], "format": _FORMAT, "collectives": merged}
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps(cached, sort_keys=True).encode())
    return CommModel(cached, world=world or 0, load=load)


if __name__ == "__main__":
    import sys
    _rank, _world, _port_, _backend, _n, _out = sys.argv[1:7]
    _worker(int(_rank), int(_world), int(_port_), _backend, int(_n), _out)
