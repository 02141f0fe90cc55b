"""The pipeline solver: number of stages, where to cut (only where a `pipeline_pivots` module
starts) and each stage's SPMD plan on its ``plan_ngpus // nstages`` devices, for the 1f1b
schedule.

For each stage count s (dividing plan_ngpus, ``tp = plan_ngpus // s <= max_partition_degree``)
the SPMD solver plans every op on tp devices; the cut is then exact dynamic programming over the
pivot starts minimising the slowest stage (its ops, the edges into them and the point-to-point
messages at both its boundaries) under the memory limit, where stage k of s keeps the activations of
``min(s - k, nmicros)`` micro-batches in flight (1f1b). Estimated step time: the 1f1b schedule
played out with the stages' forward and backward times, the messages' latency between them and
the local processes sharing the CPU (`pipeline_time`), the bubble included, then what follows
the schedule on every step: each stage's parameters' data-parallel sync and optimizer update
(the slowest stage's), and (`tail`) the step-level costs of the SPMD plan (tensors read by
several ops: their data-parallel sync and optimizer update, the reducer's bucket latencies), the
gradient all-reduce of a module tensor read in several stages (a tied embedding) across those
stages, and the two broadcasts of the step's outputs (runtime.pipeline.finals).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Tuple

from nnscaler.ir import IRGraph

from ..plan import tensor_inputs, tensor_outputs
from .cost_model import Problem, nbytes
from .pipeline_time import PipelineTiming
from .spmd_solver import Solution

__all__ = ["StagePlan", "cut_pipeline", "shared_across_stages"]


@dataclass
class StagePlan:
    nstages: int
    tp_size: int
    leads: List[int]  # op indices (in graph.nodes) where stages 1.. start
    stage_time: List[float]
    stage_mem: List[float]  # bytes per device, the stage's transient buffers included
    step_time: float  # estimated seconds for nmicros micro-batches
    stage_transient: List[float] = field(default_factory=list)  # the transient part of stage_mem


def _per_node(graph: IRGraph, problem: Problem, sol: Solution):
    """Per graph position: (time per micro-batch, the part of it paid once a step after the
    schedule (per micro-batch), param memory, activation memory, largest output) of the chosen
    plan."""
    pos = {node.id: i for i, node in enumerate(graph.nodes)}
    t = [0.0] * len(graph.nodes)
    once = [0.0] * len(graph.nodes)
    pm = [0.0] * len(graph.nodes)
    am = [0.0] * len(graph.nodes)
    out = [0.0] * len(graph.nodes)
    for k, (op, c) in enumerate(zip(problem.ops, sol.pick)):
        i = pos[op.node.id]
        t[i] += op.time[c] - op.once[c]
        once[i] += op.once[c]
        out[i] = max(out[i], op.out_bytes[c] if op.out_bytes else 0.0)
        pm[i] += op.param_mem[c]
        am[i] += op.act_mem[c]
    for e in problem.edges:
        t[pos[problem.ops[e.v].node.id]] += float(e.cost[sol.pick[e.u], sol.pick[e.v]])
        if e.mem is not None:  # a converted copy the consumer keeps: per micro-batch in flight
            am[pos[problem.ops[e.v].node.id]] += float(e.mem[sol.pick[e.u], sol.pick[e.v]])
    return t, once, pm, am, out


def _boundary_tensors(graph: IRGraph, cut: int, tp: int) -> List[Tuple[float, bool]]:
    """(bytes per device, needs a gradient) of each tensor produced before op `cut` and read at
    or after it."""
    made = {}
    for node in graph.nodes[:cut]:
        for r in tensor_outputs(graph, node):
            made[r.id] = graph.value(r)
    crossing = {r.id for node in graph.nodes[cut:] for r in tensor_inputs(graph, node) if r.id in made}
    return [(nbytes(made[v].shape, made[v].dtype) / max(1, tp), bool(made[v].requires_grad)) for v in sorted(crossing)]


def _boundary_time(graph: IRGraph, cut: int, tp: int, p2p: Callable[[float], float]) -> Tuple[float, float]:
    """Seconds of one micro-batch's messages across the boundary at `cut`, (forward, backward):
    each tensor goes as a header and a payload (runtime.pipeline.p2p), and its gradient back
    when it needs one. The runtime posts the receives ahead, so the sender writes a stage's
    messages back to back and the receiver wakes once for them: one message's latency for the
    burst, with all its bytes (a latency per message priced a 4-stage Llama's boundaries, 7
    messages each way, at 7 ms where the runtime spent under 1)."""
    tensors = _boundary_tensors(graph, cut, tp)
    fwd = [b for b, _ in tensors]
    bwd = [b for b, grad in tensors if grad]
    return tuple(p2p(sum(bs) + _HEADER_BYTES * len(bs)) if bs else 0.0 for bs in (fwd, bwd))


_HEADER_BYTES = 8 * 15  # runtime.pipeline.p2p.HEADER_LEN int64s


def shared_across_stages(graph: IRGraph, leads: Sequence[int]) -> List[Tuple[float, int]]:
    """(bytes, number of stages) of each trainable module tensor read in more than one of the
    stages that start at op indices `leads` (a tied embedding)."""
    trainable = {spec.value.id for spec in graph.tensor_specs() if spec.requires_grad}
    stages: dict = {}
    for i, node in enumerate(graph.nodes):
        k = sum(1 for c in leads if c <= i)
        for r in node.input_refs():
            if r.id in trainable:
                stages.setdefault(r.id, set()).add(k)
    return [(nbytes(graph.values[v].shape, graph.values[v].dtype), len(ks)) for v, ks in sorted(stages.items())
            if len(ks) > 1]


def cut_pipeline(graph: IRGraph, problem: Problem, sol: Solution, nstages: int, leads: Sequence[int], nmicros: int,
                 mem_limit: Optional[float], p2p: Callable[[float], float],
                 timing: Optional[PipelineTiming] = None,
                 tail: Optional[Callable[[Sequence[int]], float]] = None,
                 transient_coef: float = 0.0) -> Optional[StagePlan]:
    """The best cut of `graph` into `nstages` stages for the SPMD plan `sol` (on tp devices), or
    None when no cut fits the memory limit. The cut minimises the slowest stage; the step time
    plays the schedule out (`pipeline_time`, with `timing`) and adds ``tail(stage leads)``, the
    seconds every step spends after the schedule. A stage's memory includes its transient
    buffers: `transient_coef` times its two largest outputs (as the SPMD solver counts them)."""
    tp = problem.n
    t, once, pm, am, out = _per_node(graph, problem, sol)
    n = len(graph.nodes)
    points = [0] + sorted({c for c in leads if 0 < c < n})
    if len(points) < nstages:
        return None
    pre_t, pre_o, pre_p, pre_a = [0.0], [0.0], [0.0], [0.0]
    for i in range(n):
        pre_t.append(pre_t[-1] + t[i] + once[i])  # the cut balances the stages' whole work
        pre_o.append(pre_o[-1] + once[i])
        pre_p.append(pre_p[-1] + pm[i])
        pre_a.append(pre_a[-1] + am[i])
    bounds_of = points + [n]
    seg_top = [sorted(out[bounds_of[j]:bounds_of[j + 1]], reverse=True)[:2] for j in range(len(points))]
    messages = {c: _boundary_time(graph, c, tp, p2p) for c in points[1:]}
    comm = {c: f + b for c, (f, b) in messages.items()}
    const_mem = problem.const_mem / max(1, nstages)

    def transient(a: int, b: int) -> float:
        return transient_coef * sum(sorted((x for j in range(a, b) for x in seg_top[j]), reverse=True)[:2])

    def stage_cost(k: int, a: int, b: int) -> Tuple[float, float]:  # stage k covers points[a]..points[b]
        lo, hi = points[a], (points[b] if b < len(points) else n)
        # both ends of a boundary pay its messages: the sender's send is blocking (gloo) or
        # launched on its stream (NCCL), as the receiver's receive
        time_ = pre_t[hi] - pre_t[lo] + comm.get(lo, 0.0) + comm.get(hi, 0.0)
        mem = const_mem + pre_p[hi] - pre_p[lo] + (pre_a[hi] - pre_a[lo]) * min(nstages - k, nmicros)
        return time_, mem + transient(a, b)

    inf = math.inf
    P = len(points)
    # f[k][j]: least slowest-stage time for stages 0..k-1 covering points[0]..points[j] (exclusive)
    f = [[inf] * (P + 1) for _ in range(nstages + 1)]
    back = [[-1] * (P + 1) for _ in range(nstages + 1)]
    f[0][0] = 0.0
    for k in range(1, nstages + 1):
        for j in range(k, P + 1):
            if k == nstages and j != P:
                continue
            for i in range(k - 1, j):
                if f[k - 1][i] == inf:
                    continue
                st, sm = stage_cost(k - 1, i, j)
                if mem_limit is not None and sm > mem_limit:
                    continue
                w = max(f[k - 1][i], st)
                if w < f[k][j]:
                    f[k][j], back[k][j] = w, i
    if f[nstages][P] == inf:
        return None
    bounds, j = [], P
    for k in range(nstages, 0, -1):
        i = back[k][j]
        bounds.append((i, j))
        j = i
    bounds.reverse()
    times, mems = zip(*(stage_cost(k, a, b) for k, (a, b) in enumerate(bounds)))
    leads_out = [points[a] for a, _ in bounds[1:]]
    ends = [(points[a], points[b] if b < len(points) else n) for a, b in bounds]
    # per micro-batch, messages apart; the parameters' sync and update come after the schedule
    compute = [pre_t[hi] - pre_t[lo] - (pre_o[hi] - pre_o[lo]) for lo, hi in ends]
    after = max(pre_o[hi] - pre_o[lo] for lo, hi in ends) * nmicros
    lat = [messages[c] for c in leads_out]
    step = (timing or PipelineTiming()).seconds(compute, [f for f, _ in lat], [b for _, b in lat], nmicros)
    step += after + (tail(leads_out) if tail is not None else 0.0)
    return StagePlan(nstages, tp, leads_out, list(times), list(mems), step, [transient(a, b) for a, b in bounds])
