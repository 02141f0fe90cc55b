"""Measure the backend's collectives: latency and bandwidth per collective and group size.

`measured_comm_model(sizes, device)` returns a `CommModel` for groups of the given sizes, from
``<cache>/autodist/comm-<device>.json`` when it holds them, else by starting ``max(sizes)``
local processes (gloo on CPU, NCCL on CUDA) that time each collective at two message sizes and
fit ``time = latency + wire_bytes / bandwidth``. The result is cached; ``re_profile`` measures
again.
"""
from __future__ import annotations

import json
import os
import socket
import statistics
import time
from pathlib import Path
from typing import Dict, Iterable

import torch

from nnscaler.ir import COST_MODELS, atomic_write

from .comm_model import COLLECTIVES, CommModel, DEFAULT_PROFILE
from .op_profile import cache_dir, device_key

__all__ = ["measured_comm_model", "measure"]

_SIZES = (1 << 14, 1 << 18, 1 << 22)  # bytes of the full tensor: latency-bound to bandwidth-bound
_REPEATS = 10  # timed runs per size (after one warm-up); the median is fitted
_JOB_VARS = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE",
             "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK"}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, backend: str, sizes, out_dir: str) -> None:
    import torch.distributed as dist
    torch.set_num_threads(1)
    device = f"cuda:{rank}" if backend == "nccl" else "cpu"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        result: Dict[str, Dict[str, list]] = {}
        for n in sizes:
            group = dist.new_group(list(range(n)))
            if rank >= n:
                continue
            for coll in COLLECTIVES:
                points = []
                for full in _SIZES:
                    elems = max(n, full // 4 // n * n)
                    x = torch.ones(elems, device=device)
                    times = []
                    for i in range(_REPEATS + 1):
                        dist.barrier(group=group)
                        t = time.perf_counter()
                        _run(dist, coll, x, n, rank, group)
                        if backend == "nccl":
                            torch.cuda.synchronize()
                        if i:
                            times.append(time.perf_counter() - t)
                    wire = elems * 4 if coll == "p2p" else COST_MODELS["ring"](coll, elems * 4, n)
                    points.append((wire, statistics.median(times)))
                result.setdefault(coll, {})[str(n)] = list(_fit(points))
        if rank == 0:
            Path(out_dir, "comm.json").write_text(json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()


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


def _run(dist, coll, x, n, rank, group):
    if coll == "all_reduce":
        dist.all_reduce(x, group=group)
    elif coll == "all_gather":
        chunk = x[: x.numel() // n].clone()
        dist.all_gather_into_tensor(x, chunk, group=group)
    elif coll == "reduce_scatter":
        out = torch.empty(x.numel() // n, device=x.device)
        dist.reduce_scatter_tensor(out, x, group=group)
    elif coll == "all_to_all":
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
    else:  # p2p: rank 0 sends to rank 1
        if rank == 0:
            dist.send(x, 1, group=group)
        elif rank == 1:
            dist.recv(x, 0, group=group)


def measure(sizes: Iterable[int], device: str = "cpu", timeout: float = 300.0) -> dict:
    """Start max(sizes) local processes and measure every collective on groups of `sizes`.

    The processes run this module (``python -m``), not the user's script, so nothing of the
    user's program is re-executed."""
    import subprocess
    import sys
    import tempfile
    sizes = sorted({int(s) for s in sizes if s > 1})
    backend = "nccl" if device.startswith("cuda") else "gloo"
    world, port = max(sizes), _port()
    # A clean environment: inside torchrun (or a launcher) the variables of the running job
    # (RANK, MASTER_PORT, TORCHELASTIC_USE_AGENT_STORE, ...) must not reach the measuring group.
    env = {k: v for k, v in os.environ.items()
           if k not in _JOB_VARS and not k.startswith(("TORCHELASTIC_", "TORCH_ELASTIC_"))}
    with tempfile.TemporaryDirectory() as tmp:
        procs = [subprocess.Popen([sys.executable, "-m", __name__, str(rank), str(world), str(port), backend,
                                   ",".join(map(str, sizes)), tmp],
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
            raise RuntimeError(f"autodist: measuring {backend} collectives on {world} local processes failed "
                               f"(pass pas_config['_comm_profile'] to skip measuring):\n{errors[0]}")
        return {"backend": backend, "collectives": json.loads(Path(tmp, "comm.json").read_text())}


def measured_comm_model(sizes: Iterable[int], device: str = "cpu", re_profile: bool = False,
                        given: dict = None) -> CommModel:
    """A CommModel for groups of `sizes`: `given` profile, else cached, else measured now."""
    if given is not None:
        return CommModel(given)
    sizes = sorted({int(s) for s in sizes if s > 1})
    if not sizes:
        return CommModel(DEFAULT_PROFILE)
    path = cache_dir() / "autodist" / f"comm-{device_key(device)}.json"
    cached = {}
    if path.is_file() and not re_profile:
        try:
            cached = json.loads(path.read_text())
        except (OSError, ValueError):
            cached = {}
    have = cached.get("collectives", {}).get("all_reduce", {})
    missing = [s for s in sizes if str(s) not in have]
    if missing or not cached:
        fresh = measure(missing or sizes, device)
        merged = cached.get("collectives", {}) if cached else {}
        for coll, table in fresh["collectives"].items():
            merged.setdefault(coll, {}).update(table)
        cached = {"backend": fresh["backend"], "collectives": merged}
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps(cached, sort_keys=True).encode())
    return CommModel(cached)


if __name__ == "__main__":
    import sys
    _rank, _world, _port_, _backend, _sizes, _out = sys.argv[1:7]
    _worker(int(_rank), int(_world), int(_port_), _backend, [int(x) for x in _sizes.split(",")], _out)
