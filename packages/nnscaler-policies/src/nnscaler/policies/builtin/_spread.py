"""Helpers shared by the tensor-parallel policies: split an op over the whole unit, or replicate it."""
from __future__ import annotations

from typing import Optional, Sequence

from ..inplace_writes import VIEW_OPS, written_through_views  # noqa: F401  (tp, cp import them from here)
from ..plan import tensor_inputs
from ..primitives import assign, bind_annotation, partition, replicate


def split_over_unit(graph, node, dim: str, n: int, devices: Optional[Sequence[int]] = None) -> None:
    """Piece i of `node` (split along `dim`) on device i (on ``devices[i]`` when given)."""
    devices = range(n) if devices is None else devices
    for device, piece in zip(devices, partition(graph, node, dim, n)):
        assign(piece, device)


def replicate_over_unit(graph, node, n: int, devices: Optional[Sequence[int]] = None) -> None:
    devices = range(n) if devices is None else devices
    for device, piece in zip(devices, replicate(graph, node, n)):
        assign(piece, device)


def split_batch_or_replicate(graph, node, devices: Sequence[int]) -> None:
    """Split `node` along the dim of its first tensor input's axis 0 over `devices` when that
    dim splits evenly, else replicate it there (the `data` policy's rule for one op)."""
    n = len(devices)
    batch = dim_of_input_axis(graph, node, 0, 0) if n > 1 and tensor_inputs(graph, node) else None
    if batch is not None and batch in splittable(graph, node, n):
        split_over_unit(graph, node, batch, n, devices)
    else:
        replicate_over_unit(graph, node, n, devices)


def split_activation_batch_or_replicate(graph, node, devices: Sequence[int]) -> None:
    """As `split_batch_or_replicate`, with the leading dim of the first input that is an activation
    (not a parameter, buffer or constant): ``weight * x`` splits along x's batch, not the weight's
    width."""
    n = len(devices)
    module = {spec.value.id for spec in graph.tensor_specs()}
    ins = tensor_inputs(graph, node)
    first = next((i for i, r in enumerate(ins) if r.id not in module), None)
    batch = dim_of_input_axis(graph, node, first, 0) if n > 1 and first is not None else None
    if batch is not None and batch in splittable(graph, node, n):
        split_over_unit(graph, node, batch, n, devices)
    else:
        replicate_over_unit(graph, node, n, devices)


def splittable(graph, node, n: int) -> list:
    """The annotated dims of `node` that split evenly into n (empty when unannotated)."""
    bound = bind_annotation(graph, node)
    return bound.splittable_dims(n) if bound is not None else []


def dim_of_input_axis(graph, node, input_index: int, axis: int) -> Optional[str]:
    """The annotation's name of axis `axis` of tensor input `input_index` (None if unknown)."""
    bound = bind_annotation(graph, node)
    if bound is None or input_index >= len(bound.inputs) or bound.inputs[input_index] is None:
        return None
    names = bound.inputs[input_index]
    if not -len(names) <= axis < len(names):
        return None
    name = names[axis]
    return name[1:-1].split()[0] if name.startswith("(") else name
