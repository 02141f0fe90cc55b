"""The cost model: for every op and choice its time and memory, for every producer/consumer
pair of choices the time of the collectives between them.

Time per op and choice: the op's profiled forward + backward time, divided over the `n`
devices when split (a per-op launch overhead does not divide), plus its forward again when the
op is recomputed. Communication: the steps codegen emits between the producer's output
placement and the consumer's input placement (`nnscaler.ir.transition_steps`), forward and (when
a gradient flows) backward duals, each priced by the measured `CommModel`; a parameter's
gradient all-reduce across data-parallel units is priced on its local size, once per step, and
the all-reduce latency once per reducer bucket. Times
are per micro-batch (a step runs `nmicros` of them). Memory per device:
parameters, gradients and optimizer state (fp32 states, fp32 master weights under fp16/bf16
unless memory-efficient, ZeRO-1 dividing the optimizer part, ZeRO-3 all three) of the local shard,
under ZeRO-3 the units gathered at once (`gathered_bytes`, a transient), and the local
outputs autograd keeps for backward (`activations.py`; none inside recomputed modules; of a traced
decision's two branches, the heavier) and the converted copies a consumer keeps (edge memory).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import numpy as np

from nnscaler.ir import EXPERT_DIM, RING_DIM, ROUTED_EXPERTS, SDPA, IRGraph, Node, Replicate, Shard, step_collectives, transition_steps
from nnscaler.ir.contracts import resolve_unit_modules, unit_names

from ..plan import tensor_inputs, tensor_outputs
from .activations import counted_branches, direct_keeps, runs_in, saved_for_backward
from .choices import Choice, is_shape_query, node_choices
from .comm_model import CommModel
from .config import AutodistConfig

__all__ = ["OpVar", "Edge", "Problem", "build_problem", "gathered_bytes", "nbytes"]

R = Replicate()
_ELT = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
        "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16}


def nbytes(shape, dtype: Optional[str], cfg: Optional[AutodistConfig] = None) -> float:
    if shape is None:
        return 0.0
    elt = _ELT.get(dtype or "float32", 4)
    if cfg is not None and (cfg.use_fp16 or cfg.use_bf16) and dtype == "float32":
        elt = 2
    return float(math.prod(shape)) * elt


def _floating(dtype: Optional[str]) -> bool:
    return dtype is not None and (dtype.startswith(("float", "bfloat", "complex")))


@dataclass
class OpVar:
    """One op to decide: its choices with their time (s) and memory (bytes) per device."""

    node: Node
    choices: List[Choice]
    time: List[float]
    mem: List[float]
    compute: List[float] = field(default_factory=list)  # the compute part of `time`
    param_mem: List[float] = field(default_factory=list)
    act_mem: List[float] = field(default_factory=list)
    out_bytes: List[float] = field(default_factory=list)  # largest local output (transient memory)
    # the part of `time` paid once a step, after the micro-batches (its parameters' data-parallel
    # sync and optimizer update, per micro-batch like `time`): a pipeline pays it after its schedule
    once: List[float] = field(default_factory=list)

    @property
    def labels(self) -> List[str]:
        return [c.label for c in self.choices]


@dataclass
class Edge:
    u: int  # index of the producer OpVar
    v: int  # index of the consumer OpVar
    cost: np.ndarray  # seconds, [choice of u, choice of v]
    # bytes per device, [choice of u, choice of v]: the converted copy of the value the consumer
    # keeps for backward when the two layouts differ (None: nothing kept)
    mem: Optional[np.ndarray] = None


@dataclass
class Problem:
    n: int
    ops: List[OpVar]
    edges: List[Edge]
    const_time: float = 0.0
    const_mem: float = 0.0
    index: Dict[int, int] = field(default_factory=dict)  # node id -> op index
    # ZeRO-3: unit name -> [(op index, or -1 for a tensor stored whole; its local bytes per choice)]
    units: Dict[str, List[Tuple[int, List[float]]]] = field(default_factory=dict)

    def evaluate(self, pick: List[int]) -> Tuple[float, float]:
        """(estimated seconds, bytes per device) of a complete choice."""
        t = self.const_time + sum(op.time[c] for op, c in zip(self.ops, pick))
        t += sum(float(e.cost[pick[e.u], pick[e.v]]) for e in self.edges)
        m = self.const_mem + sum(op.mem[c] for op, c in zip(self.ops, pick))
        m += sum(float(e.mem[pick[e.u], pick[e.v]]) for e in self.edges if e.mem is not None)
        return t, m


class _Pricer:
    def __init__(self, graph: IRGraph, n: int, comm: CommModel, cfg: AutodistConfig, opt_rate: float = 0.0,
                 trainable_bytes: float = 0.0, copy_rate: float = 0.0, opt_tensor: float = 0.0):
        self.graph, self.n, self.comm, self.cfg, self.opt_rate = graph, n, comm, cfg, opt_rate
        self.copy_rate, self.opt_tensor = copy_rate, opt_tensor
        self.bucket = self.bucket_bytes(trainable_bytes)

    def optimizer_step(self, local_numel: float) -> float:
        """The optimizer's update of a local parameter (a ZeRO shard of it with use_zero: a rank
        holds pieces of about 1/group of the tensors), once per step, spread over the step's
        micro-batches: per element and per tensor (`op_profile.optimizer_tensor_cost`)."""
        tensors = 1.0
        group = self.cfg.zero_group
        local_numel /= group
        tensors /= group
        return (local_numel * self.opt_rate + tensors * self.opt_tensor) / self.cfg.nmicros

    def transition(self, src, dst, value, grad_partial: bool) -> float:
        """Seconds of the steps from `src` to `dst` placement of `value` (fwd + bwd duals)."""
        if self.n <= 1:
            return 0.0
        ndim = len(value.shape) if value.shape is not None else None
        steps = transition_steps(src, dst, grad_partial=grad_partial, ndim=ndim)
        if not steps:
            return 0.0
        fwd, bwd = step_collectives(steps)
        size = nbytes(value.shape, value.dtype, self.cfg)
        t = sum(self.comm.time(c, size, self.n) for c in fwd)
        if value.requires_grad:
            t += sum(self.comm.time(c, size, self.n) for c in bwd)
        return t

    def param_state(self, spec_bytes: float, numel: float, trainable: bool) -> float:
        """Bytes per device of a (local) parameter with its gradient and optimizer state."""
        if not trainable:
            return spec_bytes
        cfg = self.cfg
        opt = cfg.optimizer_states * 4 * numel
        if (cfg.use_fp16 and not cfg.use_memory_efficient_fp16) or (cfg.use_bf16 and not cfg.use_memory_efficient_bf16):
            opt += 4 * numel  # fp32 master weights
        group = cfg.zero_group
        if cfg.zero_stage == 3:
            # all three sharded; accumulating micro-batches (the Trainer's no_sync) keeps the units' full
            # gradients until the last backward reduce-scatters them (nnscaler.runtime.zero3)
            return (2 * spec_bytes + opt) / group + (spec_bytes if cfg.nmicros > 1 and group > 1 else 0.0)
        return 2 * spec_bytes + opt / group

    def bucket_bytes(self, trainable_bytes: float) -> float:
        """The size of the reducer's buckets: `bucket_cap_bytes`, or all the gradients if fewer."""
        return max(1.0, min(trainable_bytes, self.cfg.bucket_cap_bytes))

    def _rate(self, collective: str, n: int) -> float:
        """Seconds per byte of `collective` on buckets of `self.bucket` bytes (latency apart): a
        gradient's share of its bucket's time (gloo's time per byte is not the same at 64 KiB and
        at 16 MiB, so pricing each tensor alone over-counted the small ones)."""
        if n <= 1:
            return 0.0
        b = self.bucket
        return max(0.0, self.comm.time(collective, b, n) - self.comm.latency(collective, n)) / b

    def dp_sync(self, local_bytes: float) -> float:
        """The gradient all-reduce of a trainable tensor across data-parallel units, once per step:
        spread over the step's micro-batches (the times here are per micro-batch). Its share of
        its bucket's bandwidth time only: the latency is paid once per bucket (`dp_sync_latency`)."""
        if self.cfg.dp_size <= 1 or local_bytes <= 0:
            return 0.0
        d = self.cfg.dp_size
        if self.cfg.zero_stage == 3:
            # ZeRO-3: reduce-scattered in the zero group once a step (the last micro-batch's backward), the
            # shard's gradient all-reduced across the groups; its copy into the unit's flat gradient
            group, ngroups = self.cfg.zero_group, d // self.cfg.zero_group
            t = local_bytes * (self._rate("reduce_scatter", group) + self._rate("all_reduce", ngroups) / group)
            return (t + local_bytes * self.copy_rate) / self.cfg.nmicros
        if self.cfg.use_zero:
            # ZeRO: the gradients are reduce-scattered (zero_use_reduce_scatter) or all-reduced, and
            # after the step every rank all-gathers the updated shards of its ZeRO group
            group = max(1, d // max(1, self.cfg.zero_ngroups))
            sync = "reduce_scatter" if self.cfg.zero_use_reduce_scatter else "all_reduce"
            t = local_bytes * (self._rate(sync, d) + self._rate("all_gather", group))
            # and its copies: the gradient's shard into the flat shard, the gathered values back
            t += local_bytes * (1 + 1 / group) * self.copy_rate
            return t / self.cfg.nmicros
        return local_bytes * self._rate("all_reduce", d) / self.cfg.nmicros

    def zero3_gathers(self, local_bytes: float) -> float:
        """ZeRO-3's all-gathers of a local parameter in the zero group, per micro-batch: before its
        forward and again before its backward (freed in between); their bandwidth share only (the
        latency per unit: `zero3_latency`)."""
        if self.cfg.zero_stage != 3 or local_bytes <= 0:
            return 0.0
        return 2 * local_bytes * self._rate("all_gather", self.cfg.zero_group)

    def zero3_latency(self, units: int) -> float:
        """ZeRO-3's collective latencies per micro-batch: two all-gathers per unit, and its reduce-scatter
        (and the cross-group all-reduce) once a step."""
        group = self.cfg.zero_group
        if self.cfg.zero_stage != 3 or group <= 1 or units <= 0:
            return 0.0
        ngroups = self.cfg.dp_size // group
        once = self.comm.latency("reduce_scatter", group) + (self.comm.latency("all_reduce", ngroups)
                                                             if ngroups > 1 else 0.0)
        return units * (2 * self.comm.latency("all_gather", group) + once / self.cfg.nmicros)

    def dp_sync_latency(self, trainable_bytes: float) -> float:
        """The latency of the reducer's bucket all-reduces per micro-batch: one per bucket of
        `bucket_cap_bytes` (`trainable_bytes`: the replicated size, an upper bound)."""
        if self.cfg.dp_size <= 1 or trainable_bytes <= 0 or self.cfg.zero_stage == 3:  # ZeRO-3: per unit
            return 0.0
        buckets = max(1, math.ceil(trainable_bytes / self.cfg.bucket_cap_bytes))
        per_bucket = self.comm.latency("all_reduce", self.cfg.dp_size)
        if self.cfg.use_zero:  # and the gather of the updated shards
            per_bucket += self.comm.latency("all_gather", max(1, self.cfg.dp_size // max(1, self.cfg.zero_ngroups)))
        return buckets * per_bucket / self.cfg.nmicros


def build_problem(graph: IRGraph, n: int, op_times: Dict[int, Tuple[float, float]], comm: CommModel,
                  cfg: AutodistConfig, allowed: Optional[Dict[int, List[str]]] = None,
                  overhead: float = 1e-5, opt_rate: float = 0.0, copy_rate: float = 0.0,
                  opt_tensor: float = 0.0) -> Problem:
    """The cost model of `graph` on `n` devices. `op_times`: node id -> (forward s, backward s)
    of the whole op; `allowed`: node id -> choice labels permitted (constraints); `opt_rate`:
    seconds per parameter element of an optimizer step (`op_profile.optimizer_rate`); `copy_rate`:
    seconds per byte copied (ZeRO's copies between the parameters and the flat shards);
    `opt_tensor`: an optimizer step's seconds per parameter tensor."""
    module_values = {spec.value.id: spec for spec in graph.tensor_specs()}
    read = {r.id for node in graph.nodes for r in node.input_refs()}
    trainable = sum(nbytes(graph.value(spec.value).shape, graph.value(spec.value).dtype, cfg)
                    for spec in module_values.values() if spec.requires_grad and spec.value.id in read)
    pricer = _Pricer(graph, n, comm, cfg, opt_rate, trainable, copy_rate, opt_tensor)
    sharded = cfg.zero_stage == 3 and cfg.zero_group > 1
    units = resolve_unit_modules(graph.module_types, cfg.zero3_units) if sharded and cfg.zero3_units else ()
    unit_of = unit_names([spec.name for spec in module_values.values()], units) if sharded else {}
    allowed = allowed or {}
    ops: List[OpVar] = []
    index: Dict[int, int] = {}
    produced: Dict[int, Tuple[int, int]] = {}
    consumers: Dict[int, List[Tuple[int, int]]] = {}
    problem = Problem(n, ops, [], index=index)
    branches = counted_branches(graph)  # a step runs one side of a traced decision: the heavier counts
    kept = saved_for_backward(graph, branches)
    keeps = {node.id: direct_keeps(graph, node) for node in graph.nodes if runs_in(node, branches)}
    for node in graph.nodes:
        ins, outs = tensor_inputs(graph, node), tensor_outputs(graph, node)
        if (not ins and not outs) or is_shape_query(node):
            continue
        choices = node_choices(graph, node, n, allowed.get(node.id))
        if not choices:
            raise ValueError(f"no allowed choice for op {node.describe()}")
        fwd, bwd = op_times.get(node.id, (0.0, 0.0))
        needs_grad = node.grad_enabled and any(graph.value(r).requires_grad for r in ins)
        whole = fwd + (bwd if needs_grad else 0.0) + (fwd if node.recompute else 0.0)
        op = OpVar(node, choices, [], [])
        for c in choices:
            t = whole if not c.partitioned else min(whole, overhead) + max(0.0, whole - overhead) / n
            if c.dim == EXPERT_DIM and node.target == ROUTED_EXPERTS:  # dispatch and combine, forward (and backward): all-to-all of the routed rows
                tokens, k = graph.value(ins[1]).shape
                rows = nbytes((tokens * k, graph.value(ins[0]).shape[-1]), graph.value(ins[0]).dtype, cfg)
                t += (4 if needs_grad else 2) * comm.time("all_to_all", rows, n)
            if c.dim == RING_DIM and node.target == SDPA:  # n - 1 key/value blocks around the ring (backward: with their gradients)
                kv = sum(nbytes(graph.value(r).shape, graph.value(r).dtype, cfg) for r in ins[1:3]) / n
                t += (n - 1) * (1 + (2 if needs_grad else 0)) * comm.time("p2p", kv, 2)
            local = [nbytes(graph.value(r).shape, graph.value(r).dtype, cfg) / (n if isinstance(p, Shard) else 1)
                     for r, p in zip(outs, c.outs)]
            act = 0.0 if node.recompute else sum(b for r, b in zip(outs, local)
                                                  if r.id in kept and graph.value(r).requires_grad
                                                  and _floating(graph.value(r).dtype))
            op.compute.append(t)
            op.time.append(t)
            op.act_mem.append(act)
            op.param_mem.append(0.0)
            op.once.append(0.0)
            op.mem.append(act)
            op.out_bytes.append(max(local, default=0.0))
        index[node.id] = len(ops)
        ops.append(op)
        for k, r in enumerate(ins):
            consumers.setdefault(r.id, []).append((len(ops) - 1, k))
        for j, r in enumerate(outs):
            produced[r.id] = (len(ops) - 1, j)
    edges: Dict[Tuple[int, int], np.ndarray] = {}
    edge_mem: Dict[Tuple[int, int], np.ndarray] = {}
    for vid, uses in consumers.items():
        value = graph.values[vid]
        spec = module_values.get(vid)
        if spec is not None and len({v for v, _ in uses}) == 1:
            local = _price_module_tensor(pricer, problem, spec, value, uses)
            if sharded and spec.requires_grad:
                problem.units.setdefault(unit_of[spec.name], []).append((uses[0][0], local))
            continue
        if spec is not None:  # stored whole, read by several ops
            size = nbytes(value.shape, value.dtype, cfg)
            problem.const_mem += pricer.param_state(size, math.prod(value.shape or ()), spec.requires_grad)
            problem.const_time += (pricer.dp_sync(size) + pricer.optimizer_step(math.prod(value.shape or ()))
                                   + pricer.zero3_gathers(size) if spec.requires_grad else 0.0)
            if sharded and spec.requires_grad:
                problem.units.setdefault(unit_of[spec.name], []).append((-1, [size]))
        src = produced.get(vid)
        for v, k in uses:
            op_v = ops[v]
            if src is None:  # a graph input or a module tensor: replicated
                for b, cv in enumerate(op_v.choices):
                    extra = pricer.transition(R, cv.ins[k], value, _grad_partial(cv, cv.ins[k], value))
                    op_v.time[b] += extra
                continue
            u, j = src
            op_u = ops[u]
            cost = np.zeros((len(op_u.choices), len(op_v.choices)))
            mem = np.zeros_like(cost)
            held = (vid in keeps.get(op_v.node.id, ()) and value.requires_grad and _floating(value.dtype)
                    and not op_v.node.recompute)
            size = nbytes(value.shape, value.dtype, cfg)
            for a, cu in enumerate(op_u.choices):
                for b, cv in enumerate(op_v.choices):
                    cost[a, b] = pricer.transition(cu.outs[j], cv.ins[k], value, _grad_partial(cv, cv.ins[k], value))
                    if held and cu.outs[j] != cv.ins[k]:  # the consumer keeps its converted copy
                        mem[a, b] = size / (pricer.n if isinstance(cv.ins[k], Shard) else 1)
            if u == v:
                for a in range(len(op_u.choices)):
                    op_u.time[a] += cost[a, a]
                    op_u.mem[a] += mem[a, a]
                    op_u.act_mem[a] += mem[a, a]
            else:
                edges[(u, v)] = edges[(u, v)] + cost if (u, v) in edges else cost
                edge_mem[(u, v)] = edge_mem[(u, v)] + mem if (u, v) in edge_mem else mem
    problem.edges = [Edge(u, v, c, edge_mem[(u, v)] if edge_mem[(u, v)].any() else None)
                     for (u, v), c in edges.items() if c.any() or edge_mem[(u, v)].any()]
    problem.const_time += pricer.dp_sync_latency(trainable) + pricer.zero3_latency(len(problem.units))
    return problem


def gathered_bytes(problem: Problem, pick: List[int]) -> float:
    """ZeRO-3's transient per device for a plan: the units gathered at once, with their full gradients
    in backward: the root unit (embeddings, head: gathered through the whole pass) and two blocks
    (the one running and the next), each at its local size under the plan; 0 without ZeRO-3."""
    sizes = {name: sum(local[pick[op]] if op >= 0 else local[0] for op, local in parts)
             for name, parts in problem.units.items()}
    blocks = sorted((b for name, b in sizes.items() if name), reverse=True)
    return 2 * (sizes.get("", 0.0) + sum(blocks[:2]))


def _grad_partial(choice: Choice, place, value) -> bool:
    return choice.partitioned and isinstance(place, Replicate) and _floating(value.dtype)


def _price_module_tensor(pricer: _Pricer, problem: Problem, spec, value, uses) -> List[float]:
    """A parameter / buffer read by one op: stored as that op's choice needs it. Returns its local
    bytes per choice."""
    v = uses[0][0]
    op = problem.ops[v]
    size = nbytes(value.shape, value.dtype, pricer.cfg)
    numel = float(math.prod(value.shape or ()))
    trainable = spec.requires_grad
    sizes: List[float] = []
    for b, c in enumerate(op.choices):
        t, shard = 0.0, None
        for _, k in uses:
            need = c.ins[k]
            if isinstance(need, Shard):
                shard = need
            else:
                grad_partial = trainable and _grad_partial(c, need, value)
                t += pricer.transition(R, need, value, grad_partial)
        local = size / pricer.n if shard is not None else size
        local_numel = numel / pricer.n if shard is not None else numel
        mem = pricer.param_state(local, local_numel, trainable)
        once = pricer.dp_sync(local) + pricer.optimizer_step(local_numel) if trainable else 0.0
        gathers = pricer.zero3_gathers(local) if trainable else 0.0
        op.time[b] += t + once + gathers
        op.once[b] += once
        op.mem[b] += mem
        op.param_mem[b] += mem
        sizes.append(local)
    return sizes
