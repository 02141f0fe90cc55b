"""How much slower the model runs when the job's local processes share the CPU: measured.

Ops are profiled, and the whole graph timed, in one process. On a CPU the job then runs its
local processes at once on the same cores. Dividing the cores (``procs x threads / cores``)
is not the whole slowdown: 4 ranks of a small GPT on 2 cores ran each forward + backward 2.29x
slower than alone, not 2x (caches and memory bandwidth are shared too, and a process switched
out loses its cache). So `cpu_scale` times the traced graph (graph_timing's program) alone and
again while ``procs x threads - threads`` one-thread peers run the same program (forked from
this process, so they need nothing of the user's script), over blocks of back-to-back runs, and
takes the ratio; cached in the profile database by the graph's op mix (`op_profile.mix_key`:
a deeper model of the same layer shapes reuses it) and the process layout. Where it cannot
measure, the division of the cores is used, and the estimate says why (`cpu_scale_note`). ``NNSCALER_AUTODIST_CPU_SHARING=plain`` uses
the division without starting any process (the test suite's fast tier does).
"""
from __future__ import annotations

import multiprocessing
import os
import signal
import statistics
import time
from typing import Optional, Tuple

import torch

from nnscaler.ir import IRGraph

from .graph_timing import _execute, _inputs, _program, block_runs, block_seconds
from .op_profile import ProfileDB, mix_key
from .progress import task

__all__ = ["cpu_scale", "shared_cores", "ENV"]

ENV = "NNSCALER_AUTODIST_CPU_SHARING"
_START_TIMEOUT = 20.0  # seconds the peers get to run the program once
_MAX_FACTOR = 2.0  # a ratio above this times the plain division is a disturbed measurement


# Blocks timed alone and beside the peers (medians): 3 gave 2.0-2.7 for the same 4 processes on
# 2 cores from one graph to the next, enough to flip a choice between pipelines.
_BLOCKS = 7


def shared_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cpu_scale(graph: IRGraph, db: ProfileDB, device: str, procs: int, threads: int,
              re_profile: bool = False) -> Tuple[float, Optional[str]]:
    """(how much slower each process runs the graph beside the others than alone, why it is the
    plain division of the cores instead of a measurement or None). 1 on GPUs (a device each)."""
    if not device.startswith("cpu"):
        return 1.0, None
    cores = shared_cores()
    plain = max(1.0, procs * threads / cores)
    peers = procs * threads - threads
    if procs <= 1 or peers <= 0:
        return 1.0, None
    if os.environ.get(ENV, "measure") == "plain":
        return plain, f"{ENV}=plain: the division of the cores, not measured"
    key = f"__cpu_sharing__:{_BLOCKS}:{mix_key(graph)}:{procs}x{threads}on{cores}"

    def measure() -> dict:
        with task("cpu sharing", 1) as progress:
            progress.advance(f"the whole graph alone and beside {peers} peer processes")
            return dict(zip(("alone", "busy"), _alone_and_busy(graph, device, peers)))

    entry = db.cached(key, measure, re_profile)
    if "busy" not in entry:
        return plain, entry.get("error", "not measured")
    factor = float(entry["busy"]) / float(entry["alone"])
    if factor > _MAX_FACTOR * plain:
        return plain, f"the graph ran {factor:.2f}x slower beside its peers, over {_MAX_FACTOR * plain:.1f}"
    # never below the plain division: busy processes cannot share cores faster than that (a
    # short block can miss it: 1.67 once for 4 processes on 2 cores, 2.2-2.4 usually)
    return max(plain, factor), None


def _peer(graph: IRGraph, steps: list, device: str, stop, runs) -> None:
    torch.set_num_threads(1)  # one thread: forked OpenMP pools are not safe to use
    base = _inputs(graph, device)
    while not stop.is_set():
        _execute(graph, steps, dict(base))
        with runs.get_lock():
            runs.value += 1


def _alone_and_busy(graph: IRGraph, device: str, peers: int) -> Tuple[float, float]:
    """Seconds per forward + backward of the graph here alone, and while `peers` processes run
    it. Timed over blocks of back-to-back runs (graph_timing.BLOCK_S): a run shorter than the
    scheduler's time slice is rarely preempted, so single runs would miss most of the sharing (a
    small GPT's single runs showed 1.24x for 4 processes on 2 cores, its blocks about 2x). The
    peers are plain ``os.fork`` children (a daemonic worker may not start multiprocessing
    children); they run torch ops only and leave with ``os._exit``, never touching the
    process group a rank of a running job holds."""
    if not hasattr(os, "fork"):
        raise RuntimeError("processes cannot be forked here")
    try:
        steps = _program(graph)
        runs = block_runs(graph, steps, device)
        alone = statistics.median(block_seconds(graph, steps, device, runs) for _ in range(_BLOCKS))
    except Exception as e:  # noqa: BLE001 - a graph that cannot run whole
        raise RuntimeError(f"{type(e).__name__}: {e}"[:200]) from None
    ctx = multiprocessing.get_context("fork")
    stop, done = ctx.Event(), ctx.Value("i", 0)
    pids = []
    try:
        for _ in range(peers):
            pid = os.fork()
            if pid == 0:  # the peer
                code = 0
                try:
                    _peer(graph, steps, device, stop, done)
                except BaseException:  # noqa: BLE001 - a peer's failure shows as the parent's timeout
                    code = 1
                os._exit(code)
            pids.append(pid)
        deadline = time.monotonic() + _START_TIMEOUT
        while done.value < peers:
            if time.monotonic() > deadline or any(_exited(pid) for pid in pids):
                raise RuntimeError("the peer processes did not run the graph")
            time.sleep(0.005)
        busy = statistics.median(block_seconds(graph, steps, device, runs) for _ in range(_BLOCKS))
        return alone, busy
    finally:
        stop.set()
        _reap(pids)


def _exited(pid: int) -> bool:
    try:
        return os.waitpid(pid, os.WNOHANG) != (0, 0)
    except ChildProcessError:
        return True


def _reap(pids, grace: float = 5.0) -> None:
    """Wait for the peers to leave (they stop at the end of their run), killing late ones."""
    deadline = time.monotonic() + grace
    left = list(pids)
    while left:
        left = [pid for pid in left if not _exited(pid)]
        if left and time.monotonic() > deadline:
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                except (ProcessLookupError, ChildProcessError):
                    pass
            return
        if left:
            time.sleep(0.005)
