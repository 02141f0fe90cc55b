"""How a policy's decisions are stored on the graph: every op gets one or more pieces.

A `Piece` (``nnscaler.ir.contracts.Piece``, the contract codegen reads) is one sub-op: the
placements (R / V / D(dim), see `nnscaler.ir.layout`) of the op's tensor inputs and outputs for
that piece, and the plan device that runs it. An op replicated on two devices has two pieces with
all-R placements; an op partitioned along a dimension into n has n pieces with the placements its
annotation gives.
"""
from __future__ import annotations

from nnscaler.ir.contracts import Piece
from nnscaler.ir import NnScalerError
from nnscaler.ir import IRGraph, Node

from .inplace_writes import write_spans

__all__ = ["Piece", "PlanError", "tensor_inputs", "tensor_outputs", "validate_plan"]


class PlanError(NnScalerError, ValueError):
    """A policy produced an invalid plan, or a primitive was used wrongly; names the op."""


def tensor_inputs(graph: IRGraph, node: Node) -> list:
    return [r for r in node.input_refs() if graph.value(r).is_tensor]


def tensor_outputs(graph: IRGraph, node: Node) -> list:
    return [r for r in node.output_refs() if graph.value(r).is_tensor]


def validate_plan(graph: IRGraph, plan_ngpus: int, policy_name: str) -> None:
    """Every op has pieces, every piece a device in range(plan_ngpus)."""
    for node in graph.nodes:
        if not node.pieces:
            raise PlanError(f"policy {policy_name!r} left op {node.describe()} without a plan: "
                            f"partition, replicate or assign it")
        for piece in node.pieces:
            if piece.device is None:
                raise PlanError(f"policy {policy_name!r} did not assign {piece.describe()} of op "
                                f"{node.describe()} to a device: call assign()")
            if not 0 <= piece.device < plan_ngpus:
                raise PlanError(f"policy {policy_name!r} assigned op {node.describe()} to device "
                                f"{piece.device}, but plan_ngpus is {plan_ngpus} (devices 0..{plan_ngpus - 1})")
    if graph.pipeline is not None:
        _validate_pipeline(graph, plan_ngpus, policy_name)
    elif any(n.stage is not None for n in graph.nodes):
        raise PlanError(f"policy {policy_name!r} cut the graph into stages but gave no schedule: call "
                        f"nnscaler.policies.schedule(graph, nmicros, scheduler, ...)")


def _validate_pipeline(graph: IRGraph, plan_ngpus: int, policy_name: str) -> None:
    pipe = graph.pipeline
    if pipe.plan_ngpus != plan_ngpus:
        raise PlanError(f"policy {policy_name!r}: the pipeline has pp_size {pipe.pp_size} x tp_size {pipe.tp_size} = "
                        f"{pipe.plan_ngpus} devices, but plan_ngpus is {plan_ngpus}")
    for node in graph.nodes:
        if node.stage is None or not 0 <= node.stage < pipe.nstages:
            raise PlanError(f"policy {policy_name!r}: op {node.describe()} has stage {node.stage}, not one of the "
                            f"{pipe.nstages} pipeline stages")
        home = pipe.home_devices(node.stage)
        devices = sorted(p.device for p in node.pieces)
        if devices != list(home):
            raise PlanError(f"policy {policy_name!r}: op {node.describe()} of stage {node.stage} runs on plan devices "
                            f"{devices}; a stage's ops run on its devices {list(home)} (stage_devices())")
    for first, _, write in write_spans(graph):  # what `stage` refuses, for stages set by hand
        if graph.nodes[first].stage != write.stage:
            raise PlanError(f"policy {policy_name!r}: the in-place write {write.describe()} runs in stage {write.stage}, "
                            f"but {graph.nodes[first].describe()}, which produced what it writes, in stage "
                            f"{graph.nodes[first].stage}: the write would land in a received copy. Put them in one stage")

