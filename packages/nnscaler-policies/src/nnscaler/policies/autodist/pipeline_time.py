"""A pipeline step's time: the 1f1b schedule played out with each stage's forward and backward
times, on devices that may share CPU cores.

``(nmicros + nstages - 1) x slowest stage`` is the textbook 1f1b step. It is exact only for equal
stages on devices of their own. On a CPU where the job's processes outnumber the cores, a stage
runs slower when the others are busy and faster in the bubble, when they wait: 4 ranks on 2
cores priced a 4-stage pipeline 8 % above its measured step and a 2-stage pipeline x 2 data
parallel 26 % under it, so the choice between them was wrong (bench/autodist.py, the pipeline
case). `step_seconds` runs the schedule's actions (`nnscaler.ir.schedules`, its dependencies and
per-device order) as an event simulation: the running actions share the cores (processor
sharing), each progressing at ``min(1, cores / demand)`` of its own speed, ``demand`` being the
threads of the stages running at that moment, divided further by the measured contention beyond
plain sharing (caches, memory bandwidth, hyper-threads: 2 processes on 2 cores run 1.02-1.14x
slower than one alone here), scaled by how many of the other stages run: none, a stage alone
at its own speed; all, the measured slowdown. Without a core limit (a device per rank) it is the
schedule's critical path with the real stage times.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from nnscaler.ir.schedules import TRAINING_SCHEDULES

__all__ = ["PipelineTiming", "step_seconds", "stage_split"]


@dataclass
class PipelineTiming:
    """What `step_seconds` needs besides the stages' times: the forward's share of an op's
    forward + backward time, how much slower the stage times are than a lone process (``scale``:
    they are priced with every local process busy), the threads all local processes run, the
    cores they share (None: a device each) and the schedule."""
    fwd_share: float = 1 / 3
    scale: float = 1.0
    threads: float = 1.0
    cores: Optional[float] = None
    scheduler: str = "1f1b"

    def seconds(self, stage_times: Sequence[float], fwd_latency: Sequence[float], bwd_latency: Sequence[float],
                nmicros: int) -> float:
        """The step of `nmicros` micro-batches for stages of `stage_times` (priced at ``scale``)."""
        alone = [t / self.scale for t in stage_times]
        fwd, bwd = stage_split(alone, self.fwd_share)
        plain = max(1.0, self.threads / self.cores) if self.cores else 1.0
        return step_seconds(fwd, bwd, nmicros, self.scheduler, self.threads / len(stage_times), self.cores,
                            max(1.0, self.scale / plain), fwd_latency, bwd_latency)


def step_seconds(fwd: Sequence[float], bwd: Sequence[float], nmicros: int, scheduler: str = "1f1b",
                 threads_per_stage: float = 1.0, cores: Optional[float] = None, contention: float = 1.0,
                 fwd_latency: Sequence[float] = (), bwd_latency: Sequence[float] = ()) -> float:
    """Seconds of one step of `nmicros` micro-batches: stage k's forward takes ``fwd[k]`` and its
    backward ``bwd[k]`` seconds when it has the cores it needs. `threads_per_stage`: the threads a
    running stage keeps busy (its processes times their threads); `cores`: the cores the job's
    local processes share (None: a device each, nothing shared); `contention`: how much slower
    than plain sharing everything runs when the cores are oversubscribed (measured, >= 1).
    ``fwd_latency[k]`` / ``bwd_latency[k]``: the seconds the messages across the boundary
    between stages k and k+1 take, forward and backward: what the receiving stage waits once its
    sender is done."""
    nstages = len(fwd)
    schedule = TRAINING_SCHEDULES[scheduler](nstages, nmicros)
    lists = [schedule.actions(d) for d in range(schedule.ndevices)]
    ptr = [0] * len(lists)
    total = threads_per_stage * nstages
    running: Dict[int, Tuple[Tuple[str, int, int], float]] = {}  # device -> (action, work left in s)
    ready_at: Dict[Tuple[str, int, int], float] = {}  # a finished action's result, arrived where needed

    def cost(kind: str, stage: int) -> float:
        return (fwd if kind == "F" else bwd)[stage]

    def arrival(dep: Tuple[str, int, int], stage: int) -> float:
        kind, src, _ = dep
        lat = 0.0
        if src != stage:
            lat = (fwd_latency[min(src, stage)] if kind == "F" else bwd_latency[min(src, stage)]) \
                if (fwd_latency if kind == "F" else bwd_latency) else 0.0
        return ready_at[dep] + lat

    now = 0.0
    while True:
        waiting = []  # when a blocked device's inputs arrive
        for d, acts in enumerate(lists):
            if d in running or ptr[d] == len(acts):
                continue
            a = acts[ptr[d]]
            deps = schedule.deps(a)
            if all(dep in ready_at for dep in deps):
                at = max((arrival(dep, a.stage) for dep in deps), default=now)
                if at <= now + 1e-15:
                    running[d] = ((a.kind, a.stage, a.micro), cost(a.kind, a.stage))
                    ptr[d] += 1
                else:
                    waiting.append(at)
        if not running:
            if all(p == len(acts) for p, acts in zip(ptr, lists)):
                return now
            if not waiting:
                raise RuntimeError(f"pipeline schedule {scheduler!r} deadlocks in the simulation")
            now = min(waiting)
            continue
        rate = _rate(len(running) * threads_per_stage, threads_per_stage, total, cores, contention)
        step = min(left for _, left in running.values()) / rate
        if waiting:
            step = min(step, min(waiting) - now)
        now += step
        for d in list(running):
            key, left = running[d]
            left -= step * rate
            if left <= 1e-12:
                ready_at[key] = now
                del running[d]
            else:
                running[d] = (key, left)


def _rate(demand: float, alone: float, total: float, cores: Optional[float], contention: float) -> float:
    """The speed of each running stage when `demand` threads run (`alone`: one stage's, `total`:
    all stages'), against a stage alone on free cores."""
    if cores is None:
        return 1.0
    others = (demand - alone) / (total - alone) if total > alone else 1.0
    return min(1.0, cores / demand) / (1.0 + (contention - 1.0) * min(1.0, max(0.0, others)))


def stage_split(times: Sequence[float], fwd_share: float) -> Tuple[List[float], List[float]]:
    """Each stage's per-micro-batch time split into forward and backward by `fwd_share`."""
    return [t * fwd_share for t in times], [t * (1 - fwd_share) for t in times]
