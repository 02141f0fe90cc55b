"""Per-process resident memory (RSS) of the multiprocess CPU benches (bench/fsdp.py, bench/moe.py; not
part of nnscaler): Linux's /proc/self counters, glibc's malloc settings, and the steady-state peak
measurement of a worker (see bench/fsdp.py's docstring, part 2, for the method)."""
from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, List, Optional, Sequence, Tuple

import _common
import torch
import torch.distributed as dist

# glibc reads these when a process starts: every allocation above 64 KiB its own mapping, unmapped
# when freed, so RSS follows the live tensors
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "131072"}

# what a case's summary takes as the maximum over its ranks (`mem_summary`)
MAX_OVER_RANKS = ("peak_rss", "baseline_rss", "baseline_cold_rss", "peak_above_baseline", "build_peak",
                  "held_bytes", "steady_rss", "transient", "sampled_peak_rss")


def add_protocol_args(parser, warmup: int, rounds: int, block: int) -> None:
    """The options of the protocol bench/fsdp.py and bench/moe.py share, with the step-time defaults
    given: part 1's interleaved rounds (`_common.interleaved_rounds`), part 2's warm-up and measured
    steps (`steady_state_peak`), the losses' tolerance, glibc's malloc settings (`MALLOC_ENV`)."""
    parser.add_argument("--warmup", type=int, default=warmup, help="untimed steps of each case (part 1)")
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--block", type=int, default=block, help="steps per case per round")
    parser.add_argument("--mem-warmup", type=int, default=1)
    parser.add_argument("--mem-steps", type=int, default=3)
    parser.add_argument("--loss-rtol", type=float, default=1e-3)
    parser.add_argument("--no-malloc-env", action="store_true", help="glibc's malloc defaults in the memory workers")


def status(key: str) -> int:
    """A /proc/self/status field in bytes (VmRSS, VmHWM, RssAnon, ...)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def release() -> None:
    """Collect garbage and hand glibc's free memory back to the OS."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def reset_peak() -> int:
    """VmHWM := VmRSS; returns VmRSS."""
    Path("/proc/self/clear_refs").write_text("5")
    return status("VmRSS")


class Sampler:
    """The largest VmRSS seen, sampled every `period` s in a thread (VmHWM is the exact peak; this
    is a cross-check)."""

    def __init__(self, period: float = 0.002):
        self.period, self.peak, self._stop = period, status("VmRSS"), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, status("VmRSS"))
            time.sleep(self.period)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def held_bytes(model, opt) -> int:
    """Bytes of the distinct storages of parameters, gradients, optimizer state, ZeRO-3 shards and
    nnscaler reducer buffers (a DTensor, as FSDP2's: its local shard)."""
    seen = {}

    def add(t):
        if t is None or not torch.is_tensor(t):
            return
        t = getattr(t, "_local_tensor", t)  # DTensor
        s = t.untyped_storage()
        if s.nbytes():
            seen[s.data_ptr()] = s.nbytes()

    for p in model.parameters():
        add(p)
        add(p.grad)
    for g in opt.param_groups:
        for p in g["params"]:
            add(p)
            add(p.grad)
    for st in opt.state.values():
        for v in st.values():
            add(v)
    for m in model.modules():
        fs = getattr(m, "fully_sharded", None)
        if fs is not None:
            for u in fs.units:
                add(u.shard)
                add(None if u.shard is None else u.shard.grad)
        for b in getattr(getattr(m, "reducer", None), "_buckets", None) or []:
            add(getattr(b, "buffer", None))
    return sum(seen.values())


def warm_up_process(tiny_step: Callable[[], None], collectives: Sequence[str]) -> None:
    """`tiny_step()` (one optimizer step of a tiny single-device model, dropped when it returns) and
    one of each of `collectives` ("all_reduce", "reduce_scatter", "all_gather", "all_to_all"), in
    that order, on 4096 float32 a rank, then release: the code pages, thread pools and allocator
    arenas every case needs are then part of the baseline, not of a case's figure."""
    tiny_step()
    n = dist.get_world_size()
    x = torch.ones(4096 * n)
    for c in collectives:
        if c == "all_reduce":
            dist.all_reduce(x)
        elif c == "reduce_scatter":
            (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(torch.empty(4096), x)
        elif c == "all_gather":
            (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(torch.empty(4096 * n),
                                                                                       torch.ones(4096))
        elif c == "all_to_all":
            dist.all_to_all_single(torch.empty_like(x), x)
        else:
            raise ValueError(c)
    del x
    release()
    dist.barrier()


def baselines(tiny_step: Callable[[], None], collectives: Sequence[str]) -> Tuple[int, int]:
    """(cold, warm) VmRSS of this rank: after a barrier and `release()` ("cold baseline"), then after
    `warm_up_process(tiny_step, collectives)` ("baseline")."""
    dist.barrier()
    release()
    cold = status("VmRSS")
    warm_up_process(tiny_step, collectives)
    return cold, status("VmRSS")


@dataclass
class SteadyPeak:
    """What `steady_state_peak` measured (bytes, seconds)."""
    steady: int  # VmRSS at the reset: what is held between steps
    peak: int  # the steady-state peak RSS: VmHWM after the steps, at least `sampled`
    sampled: int  # the largest VmRSS the Sampler saw
    per_step: List[int]  # the peak so far after each step
    step_s: List[float]
    losses: List[float]
    over_budget_at_step: Optional[int]  # the index of the step over the budget (None: none)


def steady_state_peak(step: Callable[[Any], float], steps: Iterable, budget: int = 0) -> SteadyPeak:
    """Reset the peak (VmHWM := VmRSS) and start a `Sampler`, then for each s of `steps` (a step's
    index or its batch; drawn before the step's timer starts) run `step(s)` (one training step;
    returns its loss), timed, and read the peak RSS after it. With `budget` (bytes), all ranks stop
    after the first step whose peak is over it on some rank (a collective after every step)."""
    steady = reset_peak()
    sampler = Sampler()
    over_at, peaks, times, losses = None, [], [], []
    for i, s in enumerate(steps):
        t = time.perf_counter()
        losses.append(step(s))
        times.append(time.perf_counter() - t)
        peaks.append(max(status("VmHWM"), sampler.peak))
        if budget and _common.all_reduce_floats([float(peaks[-1] > budget)], dist.ReduceOp.MAX)[0]:
            over_at = i
            break
    sampled = sampler.stop()
    return SteadyPeak(steady, max(status("VmHWM"), sampled), sampled, peaks, times, losses, over_at)


@contextlib.contextmanager
def malloc_env(on: bool):
    """`MALLOC_ENV` set (`on`) or unset in os.environ inside the block, as before it afterwards: the
    processes started inside inherit it."""
    old = {k: os.environ.get(k) for k in MALLOC_ENV}
    if on:
        os.environ.update(MALLOC_ENV)
    else:
        for k in MALLOC_ENV:
            os.environ.pop(k, None)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def spawn(fn: Callable, fn_args: tuple, nproc: int, result_file: str, malloc: bool):
    """`_common.spawn_gloo(fn, fn_args, nproc, result_file)` with glibc's `MALLOC_ENV` (`malloc`) or
    its defaults in the workers."""
    with malloc_env(malloc):
        return _common.spawn_gloo(fn, fn_args, nproc, result_file)


def mem_summary(case: str, label: str, ranks: list, spawn_s: float, rank0_keys: Sequence[str] = ()) -> dict:
    """One case's memory figures from its ranks' results: the `MAX_OVER_RANKS` keys each the maximum
    over the ranks, the losses (and `rank0_keys`) of rank 0, the median step time of the rank with
    the largest peak RSS, and every rank's result."""
    big = max(ranks, key=lambda r: r["peak_rss"])
    return {"case": case, "label": label, "spawn_s": spawn_s,
            **{k: max(r[k] for r in ranks) for k in MAX_OVER_RANKS},
            "larger_rank": big["rank"], "losses": ranks[0]["losses"], **{k: ranks[0][k] for k in rank0_keys},
            "step_s_median": statistics.median(big["step_s"]) if big["step_s"] else None, "per_rank": ranks}
