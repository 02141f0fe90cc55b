"""What crosses pipeline stages: the values each stage receives and sends, and the tensors of
the module that several pipeline devices hold (their gradients are summed between them).

A stage reads the forward's arguments directly (every rank gets the micro-batch) and its own
parameters; everything else it reads from ops of another stage arrives as a message. Values that
cross are replicated over the stage's devices (the producer converts to R before sending; the
consumer starts from R), so the ``i``-th device of one stage talks to the ``i``-th of the other.

A decision both of whose branches are generated (codegen/branches.py) is taken once, by the stage
that holds its guard; a later stage whose ops test it receives it as an int message (a value id of
its own past the graph's, `StageIO.decisions`), so every stage of a micro-batch follows the branch
its data took.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Tuple

from nnscaler.ir import IRGraph, is_guard, iter_refs

from .branches import decisions_tested
from .errors import GenerationError

__all__ = ["StageIO", "stage_io", "shared_holders", "holding_groups", "loss_value"]


@dataclass
class StageIO:
    """Per stage: the value ids it receives (in order) and sends; who produces / consumes what."""

    inputs: Dict[int, List[int]] = field(default_factory=dict)
    outputs: Dict[int, List[int]] = field(default_factory=dict)
    producer: Dict[int, int] = field(default_factory=dict)  # crossing value id -> stage
    consumers: Dict[int, List[int]] = field(default_factory=dict)  # crossing value id -> stages
    kinds: Dict[int, str] = field(default_factory=dict)  # crossing value id -> 'tensor' | 'int'
    decisions: Dict[int, int] = field(default_factory=dict)  # crossing decision's value id -> its guard's id


def stage_io(graph: IRGraph) -> StageIO:
    pipe = graph.pipeline
    io = StageIO({s: [] for s in range(pipe.nstages)}, {s: [] for s in range(pipe.nstages)})
    made = {r.id: n.stage for n in graph.nodes for r in n.output_refs()}
    for node in graph.nodes:
        for ref in node.input_refs():
            src = made.get(ref.id)
            if src is None or src == node.stage:
                continue
            if src > node.stage:  # pragma: no cover - program order makes this impossible
                raise GenerationError(f"op {node.describe()} in stage {node.stage} reads a value of later stage {src}")
            kind = graph.value(ref).kind
            if kind not in ("tensor", "int"):
                raise GenerationError(
                    f"op {node.describe()} (stage {node.stage}) reads a {kind} value made in stage {src}; only tensors "
                    f"and ints cross pipeline stages: move the stage boundary (pipeline_pivots) so both are in one stage")
            io.producer[ref.id] = src
            io.kinds[ref.id] = kind
            io.consumers.setdefault(ref.id, [])
            if node.stage not in io.consumers[ref.id]:
                io.consumers[ref.id].append(node.stage)
                io.inputs[node.stage].append(ref.id)
    _decisions(graph, io)
    for ref in iter_refs(graph.output):
        if ref.id in made and ref.id not in io.producer:
            io.producer[ref.id] = made[ref.id]
            io.kinds[ref.id] = graph.value(ref).kind
            io.consumers.setdefault(ref.id, [])
    for vid, s in io.producer.items():
        io.outputs[s].append(vid)
    for s in io.outputs:
        io.outputs[s].sort()
        io.inputs[s].sort()
    return io


def _decisions(graph: IRGraph, io: StageIO) -> None:
    """The decisions that ops of a later stage than their guard's test cross as ints."""
    guards = {n.id: n for n in graph.nodes if is_guard(n) and n.kwargs.get("branches")}
    next_id = max(graph.values, default=-1) + 1
    vid_of: Dict[int, int] = {}
    for node in graph.nodes:
        for gid in sorted(decisions_tested(node)):
            src = guards[gid].stage
            if src == node.stage:
                continue
            if gid not in vid_of:
                vid_of[gid] = next_id
                io.decisions[next_id] = gid
                io.producer[next_id], io.kinds[next_id], io.consumers[next_id] = src, "int", []
                next_id += 1
            vid = vid_of[gid]
            if node.stage not in io.consumers[vid]:
                io.consumers[vid].append(node.stage)
                io.inputs[node.stage].append(vid)


def shared_holders(graph: IRGraph) -> Dict[str, List[Tuple[int, ...]]]:
    """Full name -> per local index, the plan devices holding it, for the module tensors that
    more than one pipeline device holds (a tied parameter used by two stages, every tensor of a
    Chimera stage). Their gradients are partial sums: the runtime adds them up."""
    pipe = graph.pipeline
    users = holding_groups(graph)
    out: Dict[str, List[Tuple[int, ...]]] = {}
    for spec in graph.tensor_specs():
        groups = users.get(spec.value.id, [])
        if len(groups) > 1:
            out[spec.name] = [tuple(pipe.group_devices(g)[i] for g in groups) for i in range(pipe.tp_size)]
    return out


def holding_groups(graph: IRGraph) -> Dict[int, List[int]]:
    """Module tensor value id -> the pipeline devices that hold it (every stage replica using it)."""
    pipe = graph.pipeline
    users: Dict[int, set] = {}
    for node in graph.nodes:
        for ref in node.input_refs():
            users.setdefault(ref.id, set()).update(pipe.stage_groups(node.stage))
    return {vid: sorted(g) for vid, g in users.items()}


def loss_value(graph: IRGraph):
    """The value id of the loss (the forward's output, or its first element), or None."""
    out = graph.output
    if isinstance(out, (tuple, list)) and out:
        out = out[0]
    refs = list(iter_refs(out))
    if len(refs) == 1 and out == refs[0] and graph.value(refs[0]).is_tensor:
        return refs[0].id
    return None
