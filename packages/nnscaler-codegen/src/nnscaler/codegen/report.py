"""The plan report of a planned graph: what each module's ops split, where each parameter lives,
and the collectives the generated code runs (`nnscaler.ir.contracts.PlanReport`).

Built from the same unit plan the emitter uses (`plan_unit`), with the same conversions
(`transition_steps`, once per value, layout and gradient need, as `conversions.Adapter` shares them;
again inside a recomputed segment, whose collectives may rerun in backward), so the collectives
it counts are the ones the generated forward and backward run. Bytes follow
``steps_cost(..., model='payload')``: what ``nnscaler.runtime.comm.count_collectives`` measures.

Ops the runtime runs split (`collective_ops.runtime_call`) add their own exchanges, for the traced
sizes: expert parallelism two all-to-alls forward (dispatch, combine: a rank's tokens x top-k rows of
the hidden size each; the combine's rows are those the rank's experts received, which routing decides:
the figure is the balanced one, exact summed over the unit) and two backward, the per-expert count
exchange (E integers) not counted as the runtime does not count it; with ``ep_size`` k below the
unit, also one all-gather of the rank's stored experts forward and one reduce-scatter of its group
position's E/k experts' gradients backward (packed rows, each weight's part padded:
`packed_expert_width`); the sequence-split loss one
all-reduce of its sum and denominator; ring attention with causal balance four all-to-alls forward (q, k, v
to the balanced order, the output back) and five backward (their duals, and the output reordered
again for the backward), and ``ring_send``: n - 1 steps sending a K and a V block forward, K, V
and their float32-accumulated gradients backward, plus the last gradients sent home. With an
attention mask instead of ``is_causal`` the runtime decides at run time whether the mask's rows are
causal-like and balances them then (the same all-to-alls, and the mask's intervals): the report
counts the unbalanced ring for it.
"""
from __future__ import annotations

import math
import os
from typing import Dict, Iterable, List, Optional, Set, Tuple

import torch

from nnscaler.ir import (CROSS_ENTROPY, ROUTED_EXPERTS, SDPA, as_compute_config, IRGraph, Node, Replicate, Shard, atomic_write,
                         expert_group, is_guard, iter_refs)
from nnscaler.ir import packed_expert_width
from nnscaler.ir.contracts import (Collective, ModuleReport, OpSplit, PlanReport, REPORT_JSON, REPORT_TEXT,
                                   UnannotatedOp)


from .adapters import STEP_COLLECTIVES, steps_cost, transition_steps
from .collective_ops import runtime_call
from .layouts import UnitPlan, is_shape_query, local_slices, plan_unit
from .stages import holding_groups, stage_io

__all__ = ["build_report", "write_report", "REPORT_JSON", "REPORT_TEXT"]

R = Replicate()


def build_report(graph: IRGraph, compute_config, policy: str = "?", unit: Optional[UnitPlan] = None) -> PlanReport:
    """The `PlanReport` of a planned graph (`compute_config`: a ComputeConfig or its dict)."""
    cfg = as_compute_config(compute_config)
    plan_ngpus, runtime_ngpus = cfg.plan_ngpus, cfg.runtime_ngpus
    unit = unit or plan_unit(graph, plan_ngpus)
    report = PlanReport(graph.module_class, policy, plan_ngpus, runtime_ngpus)
    modules: Dict[str, ModuleReport] = {}

    def module(path: str) -> ModuleReport:
        if path not in modules:
            modules[path] = ModuleReport(path, graph.module_types.get(path, "?").rsplit(".", 1)[-1])
        return modules[path]

    for node in graph.nodes:
        if not _data_op(graph, node):
            continue
        dim = node.pieces[0].dim if unit.partitioned.get(node.id) else None
        ops = module(node.module_path).ops
        if ops and ops[-1].op == node.short_name and ops[-1].dim == dim:
            ops[-1].count += 1
        else:
            ops.append(OpSplit(node.short_name, dim))
    _parameters(graph, unit, plan_ngpus, module, report)
    order = {path: i for i, path in enumerate(graph.module_types)}  # the order modules ran in
    report.modules = sorted(modules.values(), key=lambda m: (order.get(m.path, len(order)), _path_key(m.path)))
    counter = _collectives(graph, unit)
    report.forward, report.backward, report.recompute = (
        [Collective(k, c, b) for k, (c, b) in sorted(table.items())] for table in (counter.fwd, counter.bwd, counter.rec))
    report.runtime_ops = dict(sorted(counter.runtime_ops.items()))
    report.unannotated = _unannotated(graph, unit)
    if graph.pipeline is not None:
        pipe = graph.pipeline
        stages: Dict[int, List[str]] = {}
        for node in graph.nodes:
            top = node.module_path.split(".")
            path = ".".join(top[:2]) if len(top) > 1 and top[1].isdigit() else top[0]
            paths = stages.setdefault(node.stage, [])
            if path and path not in paths:
                paths.append(path)
        report.pipeline = {"nstages": pipe.nstages, "nmicros": pipe.nmicros, "scheduler": pipe.scheduler,
                           "pp_size": pipe.pp_size, "tp_size": pipe.tp_size, "stages": stages}
    return report


def _path_key(path: str):
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in path.split(".")] if path else []


def _data_op(graph: IRGraph, node: Node) -> bool:
    """Ops that touch tensor data (not int arithmetic, shape queries or guards)."""
    if is_shape_query(node) or is_guard(node):
        return False
    return any(graph.value(r).is_tensor for r in node.input_refs() + node.output_refs())


def _nbytes(shape, dtype: Optional[str]) -> int:
    try:
        itemsize = getattr(torch, dtype).itemsize if dtype else 4
    except AttributeError:
        itemsize = 4
    return int(math.prod(int(d) for d in (shape or ()))) * itemsize


def _parameters(graph: IRGraph, unit: UnitPlan, plan_ngpus: int, module, report: PlanReport) -> None:
    pipe = graph.pipeline
    n = unit.plan_ngpus  # devices an op covers: the unit's, or a stage's (tp_size)
    holders = holding_groups(graph) if pipe is not None else {}
    per_device = [0] * plan_ngpus
    trainable_local = 0
    for spec in graph.params.values():
        stored = unit.stored[spec.name]
        held = holders.get(spec.value.id) or [0] if pipe is not None else [0]
        full = _nbytes(spec.shape, spec.dtype)
        local_shape, _ = local_slices(tuple(spec.shape), stored, 0, n)
        local = _nbytes(local_shape, spec.dtype)
        for g in held:
            for d in (pipe.group_devices(g) if pipe is not None else range(plan_ngpus)):
                per_device[d] += local
        if spec.requires_grad and (pipe is None or 0 in held):
            # the data-parallel Reducer all-reduces each gradient plus one flag element per tensor
            trainable_local += local + _nbytes((1,), spec.dtype)
        copies = len(held) * (1 if isinstance(stored, Shard) else n)
        entry = module(spec.name.rpartition(".")[0])
        # plan_ngpus 1 (pure data parallelism): every rank holds every parameter whole
        if isinstance(stored, Shard) or (copies == 1 and plan_ngpus > 1):
            entry.params_sharded += 1
            entry.bytes_sharded += full
        else:
            entry.params_replicated += 1
            entry.bytes_replicated += full
    report.bytes_per_device = per_device
    report.dp_grad_bytes = trainable_local if report.dp_size > 1 else 0


def _collectives(graph: IRGraph, unit: UnitPlan) -> "_Counter":
    """kind -> (calls, payload bytes per rank) in the forward, in the backward and recomputed in
    backward, of one step (for a pipeline: of one micro-batch, summed over the stages)."""
    counter = _Counter(graph, unit)
    pipe = graph.pipeline
    final = {r.id for r in iter_refs(graph.output)}
    if pipe is None:
        counter.run(graph.nodes, received=set())
        for name, ref in sorted(graph.buffer_updates.items()):
            if graph.value(ref).is_tensor:
                counter.convert(ref.id, R, False, False)
        for vid in sorted(final):
            if graph.values[vid].is_tensor:
                counter.convert(vid, R, False, False)
    else:
        io = stage_io(graph)
        for stage in range(pipe.nstages):
            counter.converted = set()
            received = set(io.inputs[stage]) & final
            counter.run([nd for nd in graph.nodes if nd.stage == stage], received)
            for vid in io.outputs[stage]:
                if vid in final and graph.values[vid].is_tensor:
                    counter.convert(vid, R, False, False)
    return counter


class _Counter:
    def __init__(self, graph: IRGraph, unit: UnitPlan):
        self.graph, self.unit = graph, unit
        self.converted: Set[tuple] = set()
        self.received: Set[int] = set()
        self.fwd: Dict[str, Tuple[int, int]] = {}
        self.bwd: Dict[str, Tuple[int, int]] = {}
        self.rec: Dict[str, Tuple[int, int]] = {}
        self.runtime_ops: Dict[str, int] = {}

    def run(self, nodes: List[Node], received: Set[int]) -> None:
        self.received = received
        idx = 0
        while idx < len(nodes):
            group = nodes[idx].recompute
            end = idx + 1
            while group is not None and end < len(nodes) and nodes[end].recompute == group:
                end += 1
            before = set(self.converted)
            for node in nodes[idx:end]:
                self._node(node, recomputed=group is not None)
            if group is not None:  # conversions inside a segment are local to it (recompute.py)
                self.converted = before
            idx = end

    def _node(self, node: Node, recomputed: bool) -> None:
        if is_shape_query(node):
            return
        for need in self.unit.needs[node.id]:
            self.convert(need.ref_id, need.placement, need.grad_partial, recomputed)
        if runtime_call(node, self.unit) is not None:
            self._runtime_op(node, recomputed)

    def _runtime_op(self, node: Node, recomputed: bool) -> None:
        """The exchanges inside an op the runtime runs split (the module docstring's model)."""
        ins = [r for r in node.input_refs() if self.graph.value(r).is_tensor]
        n = self.unit.plan_ngpus
        local = lambda ref: _nbytes(self.graph.value(ref).shape, self.graph.value(ref).dtype) // n  # noqa: E731
        fwd: List[Tuple[str, float]] = []
        bwd: List[Tuple[str, float]] = []
        if node.target == ROUTED_EXPERTS:
            kind = "expert_parallel"
            hidden, index = self.graph.value(ins[0]), self.graph.value(ins[1])
            k = index.shape[1] if index.shape and len(index.shape) > 1 else 1
            rows = local(ins[0]) * k  # a rank's tokens, top-k copies of each
            fwd, bwd = [("all_to_all", rows)] * 2, [("all_to_all", rows)] * 2 if hidden.requires_grad else []
            _, group = expert_group(node.pieces[0].dim)
            if group:  # the group position's experts gathered from its replica set, their gradients reduce-scattered
                weights = [self.graph.value(ref) for ref in ins[3:]]
                stored = sum(_nbytes((w.shape[0] // n, packed_expert_width(math.prod(w.shape[1:]))), w.dtype)
                             for w in weights)  # the packed rows, padded
                fwd = fwd + [("all_gather", stored)]
                if any(w.requires_grad for w in weights):
                    bwd = bwd + [("reduce_scatter", stored * n // group)]
        elif node.target == SDPA:
            kind = "ring_attention"
            q, kv = local(ins[0]), local(ins[1]) + local(ins[2])
            args = dict(node.kwargs)
            causal = args.get("is_causal", node.args[5] if len(node.args) > 5 else False)
            if causal:  # q, k, v to the balanced order and the output back; backward their duals + the output again
                fwd = [("all_to_all", q), ("all_to_all", local(ins[1])), ("all_to_all", local(ins[2])), ("all_to_all", q)]
                bwd = fwd + [("all_to_all", q)]
            steps = n - 1
            fwd = fwd + [("ring_send", kv / 2)] * (2 * steps)
            grad = 2 if self.graph.value(ins[1]).dtype in ("float16", "bfloat16") else 1  # dK, dV summed in float32
            bwd = bwd + [("ring_send", kv / 2)] * (2 * steps) + [("ring_send", kv / 2 * grad)] * (2 * steps + 2)
        elif node.target == CROSS_ENTROPY:
            kind = "sequence_loss"
            fwd = [("all_reduce", _nbytes((2,), self.graph.value(ins[0]).dtype))]  # the sums and the denominators
        else:
            return
        self.runtime_ops[kind] = self.runtime_ops.get(kind, 0) + 1
        for name, nbytes in fwd:
            _add(self.fwd, name, nbytes)
            if recomputed:
                _add(self.rec, name, nbytes)
        for name, nbytes in bwd:
            _add(self.bwd, name, nbytes)

    def convert(self, vid: int, dst, grad_partial: bool, recomputed: bool) -> None:
        src = R if vid in self.received else self.unit.produced[vid]
        steps = transition_steps(src, dst, grad_partial=grad_partial)
        key = (vid, repr(dst), grad_partial)
        if not steps or key in self.converted:
            return
        self.converted.add(key)
        value = self.graph.values[vid]
        full = _nbytes(value.shape, value.dtype)
        n = self.unit.plan_ngpus
        for name, kwargs in steps:
            fwd_kinds, bwd_kinds = STEP_COLLECTIVES[name]
            cost = steps_cost([(name, kwargs)], full, n, model="payload")
            for kind in fwd_kinds:
                _add(self.fwd, kind, cost.forward / len(fwd_kinds))
                if recomputed:  # the segment's forward runs again in backward (at most)
                    _add(self.rec, kind, cost.forward / len(fwd_kinds))
            if value.requires_grad:  # the dual runs only when a gradient flows back
                for kind in bwd_kinds:
                    _add(self.bwd, kind, cost.backward / len(bwd_kinds))


def _add(table: Dict[str, Tuple[int, int]], kind: str, nbytes: float) -> None:
    calls, total = table.get(kind, (0, 0))
    table[kind] = (calls + 1, total + int(round(nbytes)))


def _unannotated(graph: IRGraph, unit: UnitPlan) -> List[UnannotatedOp]:
    """Ops reading tensors without a dimension annotation, by (target, user line); not those a policy
    split anyway (`cp` splits a ``new_empty`` written through views along the sequence)."""
    found: Dict[Tuple[str, str], UnannotatedOp] = {}
    for node in graph.nodes:
        if node.annotation is not None or is_shape_query(node) or is_guard(node) or unit.partitioned.get(node.id):
            continue
        if not any(graph.value(r).is_tensor for r in node.input_refs()):
            continue  # factories (torch.arange) and int arithmetic: nothing to split
        if node.source is not None:
            where = f"{os.path.basename(node.source.file)}:{node.source.line}: {node.source.code.strip()}"
        else:
            where = f"module {node.module_path or '<root>'}"
        key = (node.target, where)
        if key in found:
            found[key].count += 1
        else:
            found[key] = UnannotatedOp(node.target, where, node.module_path)
    return sorted(found.values(), key=lambda u: -u.count)


def write_report(report: PlanReport, outdir) -> List["os.PathLike"]:
    """Write ``plan_report.json`` and ``plan_report.txt`` into `outdir` (atomically); returns their paths."""
    import json
    from pathlib import Path
    outdir = Path(outdir)
    paths = []
    for name, text in ((REPORT_JSON, json.dumps(report.to_json(), indent=1, sort_keys=True)),
                       (REPORT_TEXT, report.render_text())):
        paths.append(atomic_write(outdir / name, text))
    return paths
