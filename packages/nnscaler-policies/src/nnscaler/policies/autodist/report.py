"""The plan table `verbose` prints and ``nnscaler plan show`` renders: per module its partition
(choice counts by op), estimated memory and time, and the totals."""
from __future__ import annotations

from collections import OrderedDict
from typing import Dict, List, Tuple

from .plan_file import PlanRecord

__all__ = ["module_rows", "format_plan"]


def _module_of(key: str, depth: int) -> str:
    path = key.split("|", 1)[0]
    parts = path.split(".") if path else []
    return ".".join(parts[:depth]) if parts else "(root)"


def module_rows(record: PlanRecord, depth: int = 3) -> List[Tuple[str, str, float, float, str]]:
    """(module, partition summary, memory bytes, time s, stages) per module, program order."""
    rows: "OrderedDict[str, Dict]" = OrderedDict()
    for op in record.ops:
        row = rows.setdefault(_module_of(op.key, depth), {"choices": OrderedDict(), "mem": 0.0, "time": 0.0,
                                                             "stages": set()})
        name = op.op.rsplit(".", 1)[-1]
        label = f"{name}:{op.choice}"
        row["choices"][label] = row["choices"].get(label, 0) + 1
        row["mem"] += op.mem_bytes
        row["time"] += op.time_s
        if op.stage is not None:
            row["stages"].add(op.stage)
    out = []
    for module, row in rows.items():
        parts = [f"{label}" + (f" x{k}" if k > 1 else "") for label, k in row["choices"].items() if not label.endswith(":R")]
        replicated = sum(k for label, k in row["choices"].items() if label.endswith(":R"))
        if replicated:
            parts.append(f"R x{replicated}")
        out.append((module, ", ".join(parts), row["mem"], row["time"],
                    ",".join(map(str, sorted(row["stages"]))) if row["stages"] else "-"))
    return out


def format_plan(record: PlanRecord, depth: int = 3) -> str:
    rows = module_rows(record, depth)
    head = ("module", "partition (op:choice)", "memory MB", "time ms", "stage")
    body = [(m, p, f"{mem / 2 ** 20:.2f}", f"{t * 1e3:.3f}", s) for m, p, mem, t, s in rows]
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(head)]
    widths[1] = min(widths[1], 70)

    def line(cells):
        return "  ".join(str(c)[:w].ljust(w) if i != 2 and i != 3 else str(c).rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths)))
    est = record.estimate
    lines = [f"autodist plan for {record.module_class} on plan_ngpus={record.plan_ngpus} "
             f"(task {record.task_name}, {record.method})"]
    if record.pipeline:
        p = record.pipeline
        lines.append(f"pipeline: {p['nstages']} stages x {p['tp_size']} devices, {p['nmicros']} micro-batches, "
                     f"{p['scheduler']}")
    lines += [line(head), line(["-" * w for w in widths])]
    lines += [line(r) for r in body]
    lines.append(line(["-" * w for w in widths]))
    lines.append(f"total: estimated step time {est.get('time_s', 0.0) * 1e3:.3f} ms, memory per device "
                 f"{est.get('mem_bytes', 0.0) / 2 ** 20:.2f} MB (of which transient {est.get('transient_bytes', 0.0) / 2 ** 20:.2f} MB)"
                 + (f", limit {est['mem_limit_bytes'] / 2 ** 20:.2f} MB" if est.get("mem_limit_bytes") else "")
                 + f"; search {est.get('search_s', 0.0):.3f} s")
    return "\n".join(lines)
