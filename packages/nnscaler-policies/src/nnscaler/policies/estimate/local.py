"""``--cluster local``: this machine as a cluster description, from what autodist measures.

Each local process is one "GPU" (a CPU rank, fp32, ``cores // ranks`` threads): its peak is the
rate of a 1024 x 1024 fp32 matmul (the median over 0.4 s) while the other ranks' worth of
processes run the same matmul (the cores, caches and memory bandwidth are shared as in the job),
its memory bandwidth autodist's copy measurement (`autodist.op_profile.memory_bandwidth`), its
memory the machine's RAM over the ranks; one node; both links are gloo's 2-rank all-reduce from
autodist's collective profile (cached in ``<cache>/autodist/comm-<device>.json``, measured now
when absent). The peak and the bandwidth are achieved rates, so their efficiencies are 1.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import statistics
import time
from typing import Optional, Tuple

import torch

from ..autodist.comm_profile import measured_comm_model
from ..autodist.op_profile import memory_bandwidth
from .cluster import GPU, Cluster, Link, load_cluster

__all__ = ["local_cluster", "matmul_peak_flops", "resolve_cluster"]


def _mm_seconds(n: int, block_s: float) -> float:
    """The median time of an n x n fp32 matmul over a block of back-to-back runs (a training step
    takes its typical time, not its best: the argument of autodist's whole-graph timing)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    times, start = [], time.perf_counter()
    while len(times) < 3 or time.perf_counter() - start < block_s:
        t = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _peer(n: int, threads: int, ready, stop) -> None:
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    ready.put(os.getpid())
    deadline = time.monotonic() + 120.0  # never outlive a stuck parent for long
    while not stop.is_set() and time.monotonic() < deadline:
        torch.mm(a, b)


def matmul_peak_flops(n: int = 1024, block_s: float = 0.4, peers: int = 0) -> float:
    """FLOP/s of an n x n fp32 matmul on this process's threads, while `peers` other processes
    (with as many threads) run the same matmul: the rate of one rank when all ranks compute."""
    if peers <= 0:
        return 2.0 * n ** 3 / _mm_seconds(n, block_s)
    ctx = multiprocessing.get_context("spawn")  # no fork of a process whose OpenMP threads run
    ready, stop = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_peer, args=(n, torch.get_num_threads(), ready, stop), daemon=True)
             for _ in range(peers)]
    for p in procs:
        p.start()
    try:
        for _ in procs:
            ready.get(timeout=120)
        return 2.0 * n ** 3 / _mm_seconds(n, block_s)
    finally:
        stop.set()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _gloo_link(comm: Optional[dict]) -> Tuple[float, float]:
    """(latency s per ring step, bytes/s) of a 2-rank all-reduce: `comm` given (a profile as
    autodist's ``_comm_profile``), else autodist's cached or freshly measured profile."""
    model = measured_comm_model([2], given=comm)
    latency = model.latency("all_reduce", 2)
    wire = 16.0 * 2 ** 20  # the largest size profiled: the bandwidth part dominates
    bandwidth = wire / max(model.wire_time("all_reduce", wire, 2) - latency, 1e-9)
    return latency / 2, bandwidth  # a 2-rank ring all-reduce is two latency steps


def local_cluster(comm: Optional[dict] = None, ranks: int = 1, threads: Optional[int] = None,
                  block_s: float = 0.4) -> Cluster:
    """This machine as a node of `ranks` CPU processes (one node: gpus_per_node = max(ranks, cores)),
    each with `threads` threads (default max(1, cores // ranks); set here for this process); the
    matmul rate is the median over `block_s` seconds."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 8 * 2 ** 30
    cores = _cores()
    threads = threads or max(1, cores // ranks)
    torch.set_num_threads(threads)
    latency, bandwidth = _gloo_link(comm)
    link = Link(bandwidth / 1e9, latency * 1e6)
    gpu = GPU(f"local-cpu-{threads}threads", matmul_peak_flops(block_s=block_s, peers=ranks - 1) / 1e12, ram / max(ranks, 1) / 2 ** 30,
              memory_bandwidth("cpu") / 1e9, dtype="fp32")
    source = "local: " + json.dumps({"threads": threads, "cores": cores, "ranks": ranks})
    # 10 us an op: autodist's launch overhead on CPU (docs/autodist.md, "Compute")
    return Cluster("local", gpu, max(ranks, cores), link, link, {"matmul": 1.0, "memory": 1.0}, source,
                   op_overhead_us=10.0)


def resolve_cluster(spec: str, gpus: int = 1) -> Cluster:
    """``local`` (this machine measured as a node of `gpus` ranks), else `load_cluster` (a shipped
    name or a YAML path)."""
    return local_cluster(ranks=gpus) if spec == "local" else load_cluster(spec)
