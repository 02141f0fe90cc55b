"""Which layout every value has inside a unit, and what each consumer needs.

A planned op runs on every plan device of the unit: either replicated (each device runs it
whole) or partitioned into `plan_ngpus` pieces, piece i on device i. In a pipelined graph the
same holds per stage: an op runs on the ``tp_size`` devices of its stage (replicated, or piece i
on the stage's i-th device), and `UnitPlan.plan_ngpus` is ``tp_size``. A value's layout is the
placement its producer's pieces give it (graph inputs are replicated). A consumer piece names
the placement it needs for each tensor input; a partitioned consumer reading a replicated input
produces only partial gradients for it, recorded as ``grad_partial``. Parameters, buffers and
constants are stored sharded when every consumer wants the same shard, else whole. The policy's
decisions arrive as ``Node.pieces``, a list of `nnscaler.ir.contracts.Piece`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from nnscaler.ir import IRGraph, Node, Partial, Replicate, Shard
from nnscaler.ir.contracts import Piece

from .errors import GenerationError

R = Replicate()


@dataclass
class Need:
    """What one consumer needs of one tensor input."""

    ref_id: int
    placement: object
    grad_partial: bool = False


@dataclass
class UnitPlan:
    plan_ngpus: int
    partitioned: Dict[int, bool] = field(default_factory=dict)  # node id -> split into pieces?
    produced: Dict[int, object] = field(default_factory=dict)  # value id -> placement
    needs: Dict[int, List[Need]] = field(default_factory=dict)  # node id -> tensor input needs
    stored: Dict[str, object] = field(default_factory=dict)  # param/buffer/constant name -> placement
    params: set = field(default_factory=set)  # the value ids of the parameters


def plan_unit(graph: IRGraph, plan_ngpus: int) -> UnitPlan:
    """Layouts of all values for a plan where every op covers the whole unit (or its stage)."""
    pipe = graph.pipeline
    if pipe is not None:
        if pipe.plan_ngpus != plan_ngpus:
            raise GenerationError(f"the pipeline plan has pp_size {pipe.pp_size} x tp_size {pipe.tp_size} devices, "
                                  f"but plan_ngpus is {plan_ngpus}")
        plan_ngpus = pipe.tp_size
    plan = UnitPlan(plan_ngpus, params={spec.value.id for spec in graph.params.values()})
    for spec in graph.inputs:
        for _, ref in spec.leaves:
            plan.produced[ref.id] = R
    for node in graph.nodes:
        _check_pieces(node, plan_ngpus, pipe.home_devices(node.stage) if pipe is not None else None)
        piece: Piece = node.pieces[0]
        partitioned = not piece.is_replicated() and plan_ngpus > 1
        plan.partitioned[node.id] = partitioned
        ins = [r for r in node.input_refs() if graph.value(r).is_tensor]
        outs = [r for r in node.output_refs() if graph.value(r).is_tensor]
        in_places = piece.inputs if partitioned else [R] * len(ins)
        out_places = piece.outputs if partitioned else [R] * len(outs)
        if len(in_places) != len(ins) or len(out_places) != len(outs):
            raise GenerationError(f"op {node.describe()}: the plan gives {len(in_places)} input and "
                                  f"{len(out_places)} output placements for {len(ins)} tensor inputs "
                                  f"and {len(outs)} tensor outputs")
        if is_shape_query(node):  # reads no data: the local piece is enough (sizes are rescaled)
            plan.needs[node.id] = [Need(r.id, plan.produced[r.id]) for r in ins]
        else:
            # Only floating-point values carry gradients: an int or bool input needs no R*.
            plan.needs[node.id] = [Need(r.id, p, partitioned and isinstance(p, Replicate)
                                        and _differentiable(graph.value(r).dtype))
                                   for r, p in zip(ins, in_places)]
        for r, p in zip(outs, out_places):
            plan.produced[r.id] = p
    _choose_storage(graph, plan)
    return plan


def _differentiable(dtype: Optional[str]) -> bool:
    return dtype is not None and (dtype.startswith(("float", "bfloat")) or dtype.startswith("complex"))


def is_shape_query(node: Node) -> bool:
    """size() / numel() / .shape: ops that read only a tensor's shape."""
    return node.target in ("torch.Tensor.size", "torch.Tensor.numel") or (
        node.target == "getattr" and list(node.args[1:]) == ["shape"])


def _check_pieces(node: Node, plan_ngpus: int, home=None) -> None:
    home = list(range(plan_ngpus)) if home is None else list(home)
    where = "the unit" if node.stage is None else f"stage {node.stage}"
    devices = sorted(p.device for p in node.pieces)
    if devices != home:
        raise GenerationError(
            f"op {node.describe()} runs on plan devices {devices}; every op must run on all "
            f"{plan_ngpus} devices {home} of {where} (replicated, or split into {plan_ngpus} pieces)")
    piece: Piece = node.pieces[0]
    if not piece.is_replicated():
        if any(p.device != home[p.index] for p in node.pieces) or piece.num != plan_ngpus:
            raise GenerationError(f"op {node.describe()}: piece i of a partitioned op must run on "
                                  f"device i of {where} ({home}), with {plan_ngpus} pieces")


def _choose_storage(graph: IRGraph, plan: UnitPlan) -> None:
    """Store a tensor of the module sharded when all its consumers want the same shard."""
    wants: Dict[int, set] = {}
    for node in graph.nodes:
        for need in plan.needs[node.id]:
            wants.setdefault(need.ref_id, set()).add((_key(need.placement), need.grad_partial))
    for spec in graph.tensor_specs():
        vid = spec.value.id
        placements = wants.get(vid, set())
        stored = R
        if len(placements) == 1:
            (key, grad_partial), = placements
            if key[0] == "D":
                stored = Shard(key[1])
        plan.stored[spec.name] = stored
        plan.produced[vid] = stored


def _key(p) -> Tuple:
    if isinstance(p, Shard):
        return ("D", p.dim)
    return ("V",) if isinstance(p, Partial) else ("R",)


def local_slices(shape: tuple, placement, index: int, n: int) -> Tuple[tuple, tuple]:
    """(local shape, ((start, stop) per dim)) of piece `index` of `n` of a full tensor."""
    slices = [(0, d) for d in shape]
    if isinstance(placement, Shard):
        dim = placement.dim % len(shape)
        size = shape[dim]
        if size % n:
            raise GenerationError(f"cannot split size {size} of dim {dim} into {n} even pieces")
        step = size // n
        slices[dim] = (index * step, (index + 1) * step)
    local = tuple(b - a for a, b in slices)
    return local, tuple(slices)
