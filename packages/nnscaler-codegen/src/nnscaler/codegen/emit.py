"""Emit the Python module of one runtime rank from a planned IRGraph.

The module defines one class, named after the user's module class, deriving from
`nnscaler.runtime.ParallelModule`: ``__init__`` creates this rank's parameters and buffers and
maps them to the full tensors they come from; ``_forward_impl`` has the user's forward signature
and runs this rank's ops in program order with a comment giving the user's source line above each
(a pipelined plan has one method per stage instead, pipeline_methods.py).
Generated code imports only torch, nnscaler.runtime and the user's modules of custom ops.

The parts: naming.py (the name of every value), body.py (a method's ops as `lines.Lines`, with
statements.py for one op, conversions.py for layout conversions and recompute.py for checkpointed
groups), pipeline_methods.py (stage methods and the pipeline metadata), module_class.py (the
module text).
"""
from __future__ import annotations

from typing import Dict, List, Optional

from nnscaler.ir import IRGraph, Replicate, Shard, as_compute_config, iter_refs
from nnscaler.ir.contracts import resolve_unit_modules

from .arguments import forward_signature, untraced_checks
from .body import BodyEmitter
from .conversions import Adapter
from .errors import GenerationError
from .layouts import UnitPlan, plan_unit
from .module_class import Method, init_lines, module_text
from .naming import Naming, name_values, param_local_names
from .pipeline_methods import pipeline_methods
from .random_streams import RandomOps
from .sync_batchnorm import SyncBatchNorm

__all__ = ["emit_rank", "param_local_names"]

R = Replicate()


def emit_rank(graph: IRGraph, compute_config, rank: int, policy: str, fingerprint: str,
              class_name: Optional[str] = None, unit: Optional[UnitPlan] = None) -> str:
    """The source of runtime rank `rank`'s module (`unit`: the layouts, computed when not given)."""
    compute_config = as_compute_config(compute_config)
    n = compute_config.plan_ngpus
    device = rank % n
    unit = unit or plan_unit(graph, n)
    rewrites = dict(rnd=RandomOps(graph, compute_config, unit),  # random ops draw from the runtime's stream
                    sbn=SyncBatchNorm(compute_config))  # ComputeConfig.sync_batchnorm (codegen/sync_batchnorm.py)
    naming = name_values(graph)
    meta = None
    if graph.pipeline is None:
        methods = [_forward_method(graph, naming, unit, tuple(range(rank - device, rank - device + n)), rewrites)]
    else:
        methods, meta = pipeline_methods(graph, naming, unit, rank, device, **rewrites)
    attrs = {"COMPUTE_CONFIG": compute_config.to_dict(), "RANK": rank, "GRAPH_FINGERPRINT": fingerprint,
             "TRACED_TRAINING": bool(graph.traced_training),
             "RANDOM": rewrites["rnd"].class_attr() if rewrites["rnd"].nops else None,
             "MODE_DIVERGENCE": graph.mode_divergence, "PIPELINE": meta.to_dict() if meta is not None else None,
             "SHARD_UNITS": _shard_units(graph, compute_config)}
    header = dict(rank=rank, world=compute_config.runtime_ngpus, device=device, plan=n,
                  module_class=graph.module_class, policy=policy, fingerprint=fingerprint)
    return module_text(graph, class_name or graph.module_class.rsplit(".", 1)[-1], attrs,
                       init_lines(graph, naming.local, unit, device, compute_config), methods, header)


def _shard_units(graph: IRGraph, compute_config) -> Optional[List[str]]:
    """use_zero=3's units named in pas_config['zero3_units'], as module paths (None: the runtime's
    default, each repeated block)."""
    names = compute_config.pas_config.get("zero3_units")
    if compute_config.zero_stage != 3 or not names:
        return None
    return resolve_unit_modules(graph.module_types, names)


def _forward_method(graph: IRGraph, naming: Naming, unit: UnitPlan, ranks: tuple, rewrites: dict) -> Method:
    """``_forward_impl``: every op of the graph, then the outputs made whole on every rank."""
    adapt = Adapter(unit, naming.names, naming.taken, ranks)
    keep = {r.id for r in iter_refs(graph.output)} | {r.id for r in iter_refs(graph.buffer_updates)}
    body = BodyEmitter(graph, naming, adapt, unit, keep, **rewrites).emit(
        graph.nodes, untraced_checks(graph) + naming.arg_lines)
    body.extend(_buffer_update_lines(graph, unit, naming.local, adapt))
    body.extend(adapt.outputs(graph))
    body.append("return " + adapt.renderer_for(None).value(graph.output))
    return Method("_forward_impl", forward_signature(graph), body)


def _buffer_update_lines(graph: IRGraph, unit: UnitPlan, local: Dict[str, str], adapt: Adapter) -> List[str]:
    """Rebind the buffers forward reassigned to their new (whole) values, as the model does."""
    lines: List[str] = []
    for name, ref in sorted(graph.buffer_updates.items()):
        if isinstance(unit.stored[name], Shard):
            raise GenerationError(f"forward reassigns buffer {name}, which the plan stores split: update it in "
                                  f"place (self.<buffer>.copy_(new)), or replicate the ops that read it")
        var = adapt.convert(ref.id, R, False, lines) if graph.value(ref).is_tensor else None
        lines.append(f"self.{local[name]} = {var or adapt.renderer_for(None).value(ref)}")
    return lines
