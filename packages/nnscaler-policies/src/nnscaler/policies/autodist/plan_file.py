"""Plans as JSON: what autodist chose for every op (by stable op key), the pipeline, the
estimates. Loading one checks it against the current graph and plan_ngpus and refuses a stale
or mismatched plan with the reason (nothing in it is executed)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from nnscaler.ir import ConfigError, IRGraph, atomic_write

from ..plan import tensor_inputs
from .choices import node_choices
from .op_keys import op_keys

__all__ = ["PlanRecord", "OpRecord", "save_plan", "load_plan", "read_plan", "FORMAT"]

FORMAT = "nnscaler-autodist-plan"
VERSION = 1


class StalePlanError(ConfigError):
    """A plan file that does not fit the current model or config; the message says why."""


@dataclass
class OpRecord:
    key: str
    op: str
    module: str
    choice: str  # "R" or the annotated dim split
    shapes: List[Optional[list]]
    stage: Optional[int] = None
    time_s: float = 0.0
    mem_bytes: float = 0.0


@dataclass
class PlanRecord:
    module_class: str
    plan_ngpus: int
    ops: List[OpRecord]
    estimate: Dict[str, float] = field(default_factory=dict)  # time_s, mem_bytes, search_s, ...
    pipeline: Optional[dict] = None  # {"nstages", "tp_size", "nmicros", "scheduler"}
    task_name: str = "default"
    method: str = ""

    def to_json(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "module_class": self.module_class,
                "plan_ngpus": self.plan_ngpus, "task_name": self.task_name, "method": self.method,
                "estimate": self.estimate, "pipeline": self.pipeline,
                "ops": [vars(o) for o in self.ops]}

    @classmethod
    def from_json(cls, data, where: str) -> "PlanRecord":
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise StalePlanError(f"{where} is not an autodist plan (no \"format\": \"{FORMAT}\"); give a file written "
                                 f"by pas_config['save_plan_path']")
        if data.get("version") != VERSION:
            raise StalePlanError(f"{where} has plan format version {data.get('version')!r}; this nnscaler reads "
                                 f"version {VERSION}: search again (drop load_plan_path)")
        try:
            ops = [OpRecord(**o) for o in data["ops"]]
            pipeline = data.get("pipeline")
            if pipeline is not None and (not isinstance(pipeline, dict)
                                         or not {"nstages", "tp_size", "nmicros", "scheduler"} <= set(pipeline)):
                raise ValueError("'pipeline' must be null or a mapping with nstages, tp_size, nmicros and scheduler")
            return cls(data["module_class"], int(data["plan_ngpus"]), ops, dict(data.get("estimate") or {}),
                       data.get("pipeline"), data.get("task_name", "default"), data.get("method", ""))
        except (KeyError, TypeError, ValueError) as e:
            raise StalePlanError(f"{where} is a damaged autodist plan ({type(e).__name__}: {e}); search again "
                                 f"(drop load_plan_path) or restore the file") from None


def op_shapes(graph: IRGraph, node) -> List[Optional[list]]:
    return [list(graph.value(r).shape) if graph.value(r).shape is not None else None
            for r in tensor_inputs(graph, node)]


def save_plan(record: PlanRecord, path) -> None:
    import os
    from pathlib import Path
    Path(os.fspath(path)).parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, (json.dumps(record.to_json(), indent=1) + "\n").encode())


def read_plan(path) -> PlanRecord:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise StalePlanError(f"cannot read the autodist plan {path}: {e.strerror}") from None
    except ValueError as e:
        raise StalePlanError(f"{path} is not valid JSON ({e}); give a plan written by save_plan_path") from None
    return PlanRecord.from_json(data, str(path))


def load_plan(path, graph: IRGraph, plan_ngpus: int) -> PlanRecord:
    """The plan at `path`, checked against `graph`: every op present with the same shapes and a
    choice it can take on its devices."""
    record = read_plan(path)
    why = []
    if record.plan_ngpus != plan_ngpus:
        why.append(f"it was made for plan_ngpus={record.plan_ngpus}, this run has plan_ngpus={plan_ngpus}")
    if record.module_class != graph.module_class:
        why.append(f"it was made for {record.module_class}, this model is {graph.module_class}")
    by_key = {o.key: o for o in record.ops}
    keys = op_keys(graph)
    tp = record.pipeline["tp_size"] if record.pipeline else plan_ngpus
    for node in graph.nodes:
        rec = by_key.pop(keys[node.id], None)
        if rec is None:
            why.append(f"op {keys[node.id]} ({node.describe()}) is not in the plan")
            continue
        if rec.shapes != op_shapes(graph, node):
            why.append(f"op {rec.key} had input shapes {rec.shapes}, now {op_shapes(graph, node)}")
        elif rec.choice not in [c.label for c in node_choices(graph, node, tp)]:
            why.append(f"op {rec.key} cannot be split along {rec.choice!r} on {tp} devices")
        if len(why) >= 8:
            break
    if by_key and len(why) < 8:
        why.append(f"the plan has ops the model no longer has: {', '.join(sorted(by_key)[:5])}"
                   + (" ..." if len(by_key) > 5 else ""))
    if why:
        raise StalePlanError(f"autodist plan {path} does not fit this model: " + "; ".join(why)
                             + ". The model or config changed since it was saved: search again (drop "
                             "pas_config['load_plan_path'], or set save_plan_path to refresh the file)")
    return record
