"""``--cluster local``: this machine as a cluster description, from what autodist measures.

Each local process is one "GPU" (a CPU rank, fp32): its peak is the rate of a 1024 x 1024 fp32
matmul at the process's thread count (best of 3), its memory bandwidth autodist's copy
measurement (`autodist.op_profile.memory_bandwidth`), its memory the machine's RAM over the
cores; one node of as many ranks as cores; both links are gloo's 2-rank all-reduce from
autodist's collective profile (cached in ``<cache>/autodist/comm-<device>.json``, measured now
when absent). The peak and the bandwidth are achieved rates, so their efficiencies are 1.
"""
from __future__ import annotations

import json
import os
import time
from typing import Optional, Tuple

import torch

from ..autodist.comm_profile import measured_comm_model
from ..autodist.op_profile import memory_bandwidth
from .cluster import GPU, Cluster, Link, load_cluster

__all__ = ["local_cluster", "matmul_peak_flops", "resolve_cluster"]


def matmul_peak_flops(n: int = 1024, repeats: int = 3) -> float:
    """FLOP/s of an n x n fp32 matmul on this process's threads (the fastest of `repeats`)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t)
    return 2.0 * n ** 3 / best


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


def local_cluster(comm: Optional[dict] = None) -> Cluster:
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 8 * 2 ** 30
    cores = _cores()
    latency, bandwidth = _gloo_link(comm)
    link = Link(bandwidth / 1e9, latency * 1e6)
    gpu = GPU(f"local-cpu-{torch.get_num_threads()}threads", matmul_peak_flops() / 1e12, ram / cores / 2 ** 30,
              memory_bandwidth("cpu") / 1e9, dtype="fp32")
    source = "local: " + json.dumps({"threads": torch.get_num_threads(), "cores": cores})
    # 10 us an op: autodist's launch overhead on CPU (docs/autodist.md, "Compute")
    return Cluster("local", gpu, cores, link, link, {"matmul": 1.0, "memory": 1.0}, source, op_overhead_us=10.0)


def resolve_cluster(spec: str) -> Cluster:
    """``local`` (this machine, measured), else `load_cluster` (a shipped name or a YAML path)."""
    return local_cluster() if spec == "local" else load_cluster(spec)
