"""The methods of a pipelined rank module and its `PipelineMeta` (the ``PIPELINE`` attribute).

Instead of ``_forward_impl`` a pipelined module has, for each stage this rank holds,
``_stage_{s}(self, _acts, *forward args)``: it unpacks the values it receives from other stages
(``_acts``, in `PipelineMeta.inputs` order), runs the stage's ops and returns the values it sends
(`PipelineMeta.outputs` order; a forward output made whole for the caller). Every rank also has
``_pipeline_output(self, _vals)``, which builds the forward's result from the final values by id,
and ``_check_sample``, the argument checks run once per sample before the step's first message.

Both branches of a decision (codegen/branches.py) are generated in every stage: the stage holding
the decision's guard takes it and sends it to the later stages that test it (stages.py); a value
assigned on one branch only goes as a placeholder when the micro-batch took the other (`_sent`).
"""
from __future__ import annotations

from typing import List

from nnscaler.ir import IRGraph, Ref, Replicate, iter_refs
from nnscaler.ir.contracts import PipelineMeta

from .arguments import forward_signature, untraced_checks
from .body import BodyEmitter
from .branches import decision_var
from .conversions import Adapter
from .errors import GenerationError
from .layouts import UnitPlan
from .lines import Lines
from .module_class import Method
from .naming import Naming
from .render import Renderer
from .stages import StageIO, loss_value, shared_holders, stage_io
from .statements import unpack_target

__all__ = ["pipeline_methods", "pipeline_meta"]

R = Replicate()


def pipeline_methods(graph: IRGraph, naming: Naming, unit: UnitPlan, rank: int, device: int,
                     **rewrites) -> tuple:
    """(methods, PipelineMeta) of plan device `device` (global rank `rank`); `rewrites`: the
    BodyEmitter's random-op and batch-norm rewrites."""
    if graph.buffer_updates:
        raise GenerationError(f"forward reassigns buffer(s) {', '.join(sorted(graph.buffer_updates))} "
                              f"(self.name = new tensor), which a pipelined plan does not support: update "
                              f"them in place instead (self.name.copy_(new), self.name.mul_(...))")
    pipe, names = graph.pipeline, naming.names
    io = stage_io(graph)
    names.update((vid, decision_var(gid)) for vid, gid in io.decisions.items())  # decisions cross as ints
    signature = forward_signature(graph)
    unit_start = rank - device
    final = {r.id for r in iter_refs(graph.output)}
    methods: List[Method] = []
    for stage, _ in pipe.stages_of(device):
        ranks = tuple(unit_start + d for d in pipe.group_devices(device // pipe.tp_size))
        # a crossing value keeps its producer's placement (device i sends its piece to device i),
        # except a forward output, which the producer makes whole for the caller
        adapt = Adapter(unit, names, naming.taken, ranks, received=set(io.inputs[stage]) & final)
        received = [Ref(v) for v in io.inputs[stage]]
        head = list(naming.arg_lines)  # the arguments were checked once per step (_check_sample)
        if received:
            head.append(unpack_target(received, adapt.renderer_for(None)) + " = _acts")
        sent = {io.decisions[v] for v in io.outputs[stage] if v in io.decisions}
        emitter = BodyEmitter(graph, naming, adapt, unit, set(io.outputs[stage]), decisions_out=sent, **rewrites)
        body = emitter.emit([nd for nd in graph.nodes if nd.stage == stage], head, received)
        outs = []
        for vid in io.outputs[stage]:
            lines: List[str] = []
            var = adapt.convert(vid, R, False, lines) if vid in final and graph.values[vid].is_tensor else None
            body.extend(lines)
            outs.append(_sent(var or names[vid], emitter.conditions, io.kinds[vid]))
        body.append("return (" + ", ".join(outs) + ("," if len(outs) == 1 else "") + ")")
        methods.append(Method(f"_stage_{stage}", "_acts" + (", " + signature if signature else ""), body))
    loose = [r.id for r in iter_refs(graph.output) if r.id not in io.producer]
    if loose:
        raise GenerationError(f"a pipelined forward must return values computed by its ops; it returns "
                              f"{', '.join(graph.values[v].name for v in loose)} as is (an argument or a "
                              f"parameter): return only computed values")
    out_names = dict(names)
    out_names.update({vid: f"_vals[{vid}]" for vid in io.producer})
    methods.append(Method("_pipeline_output", "_vals", Lines(["return " + Renderer(out_names).value(graph.output)])))
    # every rank checks every sample before the step's first message: a bad one fails on all
    # ranks at once instead of leaving the other stages waiting for a message
    methods.append(Method("_check_sample", signature, Lines(untraced_checks(graph) + ["return None"])))
    return methods, pipeline_meta(graph, io)


def _sent(var: str, conditions: dict, kind: str) -> str:
    """What a stage sends for `var`: a variable that only one branch of a decision assigns is sent
    as a placeholder (an empty tensor, or 0) when the micro-batch took the other branch; the
    receiving stage reads it only on that branch too."""
    if var not in conditions:
        return var
    gid, side = conditions[var]
    absent = "torch.empty(0, device=self.device)" if kind == "tensor" else "0"
    return f"({var} if {'' if side else 'not '}{decision_var(gid)} else {absent})"


def pipeline_meta(graph: IRGraph, io: StageIO = None) -> PipelineMeta:
    """The pipeline description every rank's module carries (identical on all ranks)."""
    pipe = graph.pipeline
    io = io or stage_io(graph)
    shared = shared_holders(graph)
    groups = sorted({g for per_index in shared.values() for g in per_index})
    return PipelineMeta(pipe.nstages, pipe.nmicros, pipe.scheduler, pipe.pp_size, pipe.tp_size,
                        inputs={s: tuple(v) for s, v in io.inputs.items()},
                        outputs={s: tuple(v) for s, v in io.outputs.items()},
                        producer=dict(io.producer), consumers={k: tuple(v) for k, v in io.consumers.items()},
                        kinds=dict(io.kinds), loss=loss_value(graph), shared_groups=tuple(groups),
                        shared={name: tuple(tuple(h) for h in per_index) for name, per_index in shared.items()})
