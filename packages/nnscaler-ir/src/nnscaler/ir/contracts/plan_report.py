"""What a plan did, in one typed record: `PlanReport`, the contract between codegen, which writes
it, and the runtime, which reads it (also on a machine that only runs generated code).

Codegen computes it from the planned graph (it knows every value's layout, every parameter's
storage and every collective it emits: ``nnscaler.codegen.report.build_report``); the runtime
prints it (``parallelize(..., verbose=True)``), stores it in the gen_savedir
(``plan_report.json`` + ``plan_report.txt``) and warns when a plan splits little
(`PlanReport.warnings`). The record is plain data: JSON in, JSON out, no pickle.

Figures are for the traced example inputs: activation bytes scale with the batch the data has.
Bytes of collectives are the payload one rank hands to the collective, the convention of
``nnscaler.runtime.comm.count_collectives`` (all-reduce and reduce-scatter B, all-gather and
all-to-all B/n for a full tensor of B bytes), so a measured run can be compared exactly.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Tuple

__all__ = ["PlanReport", "ModuleReport", "OpSplit", "Collective", "UnannotatedOp", "REPLICATED_WARN_FRACTION",
           "REPORT_VERSION", "REPORT_JSON", "REPORT_TEXT"]

REPORT_VERSION = 1
REPORT_JSON = "plan_report.json"  # the files of a gen_savedir that hold the report
REPORT_TEXT = "plan_report.txt"
# A plan over plan_ngpus > 1 devices that leaves more than this fraction of the parameter bytes
# whole on several devices of the unit warns (PlanWarning): tensor parallelism that mostly
# replicates costs communication and saves little memory.
REPLICATED_WARN_FRACTION = 0.5
# policies whose plans keep every weight whole on purpose (`cp` splits the sequence: activations)
WHOLE_WEIGHT_POLICIES = ("cp",)


@dataclass
class OpSplit:
    """`count` ops calling `op` (short name: ``linear``) split along annotated dim `dim` (None: replicated)."""

    op: str
    dim: Optional[str]
    count: int = 1


@dataclass
class ModuleReport:
    """One module path: the ops that ran directly in it (not in its children) and its own parameters."""

    path: str  # '' is the root module
    type: str  # class name, e.g. 'Linear'
    ops: List[OpSplit] = field(default_factory=list)
    params_sharded: int = 0  # tensors split over the unit's devices (or held by one pipeline device)
    params_replicated: int = 0  # tensors held whole by several devices of the unit
    bytes_sharded: int = 0  # full bytes of those tensors
    bytes_replicated: int = 0

    @property
    def split_ops(self) -> int:
        return sum(o.count for o in self.ops if o.dim is not None)

    @property
    def num_ops(self) -> int:
        return sum(o.count for o in self.ops)


@dataclass
class Collective:
    """Calls of one collective kind in one pass, and the payload bytes one rank hands to them."""

    kind: str  # all_reduce, all_gather, reduce_scatter, all_to_all; ring_send: ring attention's blocks (isend)
    calls: int = 0
    bytes: int = 0


@dataclass
class UnannotatedOp:
    """An op with no dimension annotation (it can only run replicated), by the user's line."""

    target: str  # torch.addmm
    where: str  # 'model.py:42: x = torch.addmm(b, x, w)' (or the module path when no line is known)
    module: str
    count: int = 1


@dataclass
class PlanReport:
    module_class: str
    policy: str
    plan_ngpus: int
    runtime_ngpus: int
    modules: List[ModuleReport] = field(default_factory=list)
    forward: List[Collective] = field(default_factory=list)  # per step (one forward), per rank
    backward: List[Collective] = field(default_factory=list)  # the duals of the forward's collectives
    # forward collectives inside recomputed segments (activation checkpointing) that run again in
    # backward: an upper bound, torch's non-reentrant checkpoint stops recomputing a segment once it
    # has every tensor backward needs, so a segment's trailing collectives may not rerun
    recompute: List[Collective] = field(default_factory=list)
    unannotated: List[UnannotatedOp] = field(default_factory=list)
    bytes_per_device: List[int] = field(default_factory=list)  # parameter bytes held by each plan device
    # payload bytes each rank all-reduces across data-parallel replicas per step (its gradients, plus the
    # Reducer's one flag element per tensor), counted apart as 'dp_all_reduce'; 0 when dp_size is 1
    dp_grad_bytes: int = 0
    pipeline: Optional[dict] = None  # nstages, nmicros, scheduler, pp_size, tp_size, stages: {s: [module paths]}
    # ops the runtime runs split in a way no annotation expresses, by kind: {"ring_attention": calls,
    # "expert_parallel": calls, "sequence_loss": calls} (context parallelism: attention as a ring, the
    # loss over each rank's tokens; expert parallelism: experts split over the unit, tokens exchanged);
    # their exchanges are in forward / backward
    runtime_ops: Dict[str, int] = field(default_factory=dict)
    version: int = REPORT_VERSION

    # -- totals -------------------------------------------------------------------------------
    @property
    def dp_size(self) -> int:
        return self.runtime_ngpus // self.plan_ngpus

    @property
    def params_sharded(self) -> int:
        return sum(m.params_sharded for m in self.modules)

    @property
    def params_replicated(self) -> int:
        return sum(m.params_replicated for m in self.modules)

    @property
    def bytes_sharded(self) -> int:
        return sum(m.bytes_sharded for m in self.modules)

    @property
    def bytes_replicated(self) -> int:
        return sum(m.bytes_replicated for m in self.modules)

    @property
    def replicated_fraction(self) -> float:
        total = self.bytes_sharded + self.bytes_replicated
        return self.bytes_replicated / total if total else 0.0

    def collectives(self, which: str = "forward") -> Dict[str, Tuple[int, int]]:
        """kind -> (calls, bytes) for 'forward', 'backward' (the duals), 'recompute' (at most, rerun
        in backward by activation checkpointing) or 'step' (forward and backward)."""
        out: Dict[str, Tuple[int, int]] = {}
        passes = {"forward": [self.forward], "backward": [self.backward], "recompute": [self.recompute],
                  "step": [self.forward, self.backward]}[which]
        for entries in passes:
            for c in entries:
                calls, nbytes = out.get(c.kind, (0, 0))
                out[c.kind] = (calls + c.calls, nbytes + c.bytes)
        return out

    def total_calls(self) -> int:
        return sum(c.calls for c in self.forward + self.backward)

    # -- JSON ---------------------------------------------------------------------------------
    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "PlanReport":
        if not isinstance(data, dict) or data.get("version") != REPORT_VERSION:
            raise ValueError(f"not a plan report of version {REPORT_VERSION}: "
                             f"{data.get('version') if isinstance(data, dict) else type(data).__name__!r}")
        data = dict(data)
        data["modules"] = [ModuleReport(**{**m, "ops": [OpSplit(**o) for o in m["ops"]]}) for m in data["modules"]]
        data["forward"] = [Collective(**c) for c in data["forward"]]
        data["backward"] = [Collective(**c) for c in data["backward"]]
        data["recompute"] = [Collective(**c) for c in data.get("recompute", [])]
        data["unannotated"] = [UnannotatedOp(**u) for u in data["unannotated"]]
        if data.get("pipeline") is not None:
            data["pipeline"] = dict(data["pipeline"])
            data["pipeline"]["stages"] = {int(k): v for k, v in data["pipeline"].get("stages", {}).items()}
        return cls(**data)

    # -- warnings -------------------------------------------------------------------------------
    def warnings(self) -> List[str]:
        """The messages a plan that splits little deserves (empty for a plan that splits well)."""
        if self.plan_ngpus <= 1 or self.pipeline is not None and self.pipeline.get("tp_size", 1) <= 1:
            return []
        if self.policy in WHOLE_WEIGHT_POLICIES:  # they split the activations and keep the weights whole, by design
            return []
        total = self.bytes_sharded + self.bytes_replicated
        calls = self.total_calls()
        if self.bytes_sharded == 0 and calls:
            what = (f"policy {self.policy!r} over plan_ngpus={self.plan_ngpus} shards no parameter but sends "
                    f"{calls} collectives per step")
        elif total and self.replicated_fraction > REPLICATED_WARN_FRACTION:
            what = (f"policy {self.policy!r} over plan_ngpus={self.plan_ngpus} leaves "
                    f"{100 * self.replicated_fraction:.0f}% of the parameter bytes replicated on every device "
                    f"(more than {100 * REPLICATED_WARN_FRACTION:.0f}%)")
        else:
            return []
        return [what + ".\n" + self._summary_for_warning()]

    def _summary_for_warning(self) -> str:
        lines = [f"  parameters: sharded {self.params_sharded} ({_bytes(self.bytes_sharded)}), replicated "
                 f"{self.params_replicated} ({_bytes(self.bytes_replicated)})",
                 f"  collectives per step and rank: {_calls_line(self.collectives('forward'))} forward, "
                 f"{_calls_line(self.collectives('backward'))} backward"]
        largest = sorted((m for m in self.modules if m.bytes_replicated), key=lambda m: -m.bytes_replicated)[:3]
        if largest:
            lines.append("  largest replicated modules: " + ", ".join(
                f"{m.path or '<root>'} ({m.type}, {_bytes(m.bytes_replicated)})" for m in largest))
        if self.unannotated:
            lines.append("  ops without a dimension annotation (they run replicated):")
            lines.extend(f"    {u.target} x{u.count} at {u.where}" for u in self.unannotated[:3])
            if len(self.unannotated) > 3:
                lines.append(f"    +{len(self.unannotated) - 3} more")
        example = re.sub(r"\.\d+(?=\.|$)", ".*", largest[0].path) if largest and largest[0].path else "*.fc1"
        lines.append(f"  fix: make the policy split the large modules, e.g. policy 'megatron' with "
                     f"pas_config={{'column': [...], 'row': [...]}} holding globs of your module paths "
                     f"(such as {example!r})")
        if self.unannotated:
            lines.append(f"       and give the ops without an annotation one: nnscaler.register_op("
                         f"{self.unannotated[0].target}, '<annotation>') (docs/tracing.md)")
        lines.append("  full report: plan_report.txt in the gen_savedir, or parallelize(..., verbose=True)")
        return "\n".join(lines)

    # -- text -------------------------------------------------------------------------------------
    def render_text(self) -> str:
        out = [f"Plan report: {self.module_class}",
               f"  policy {self.policy}; plan_ngpus {self.plan_ngpus} x data-parallel {self.dp_size} "
               f"(runtime_ngpus {self.runtime_ngpus})"]
        if self.runtime_ops:
            n = self.pipeline["tp_size"] if self.pipeline is not None else self.plan_ngpus
            names = {"ring_attention": f"context parallel: ring attention over {n} ranks",
                     "expert_parallel": f"expert parallel: experts split over {n} ranks, tokens exchanged",
                     "sequence_loss": f"loss over the tokens split over {n} ranks"}
            out.append("  " + "; ".join(f"{names.get(k, k)} (x{c} a step)" for k, c in sorted(self.runtime_ops.items())
                                        ))
        if self.pipeline is not None:
            p = self.pipeline
            out.append(f"  pipeline: {p['nstages']} stages on {p['pp_size']} pipeline devices x tp {p['tp_size']}, "
                       f"{p['nmicros']} micro-batches, scheduler {p['scheduler']}")
            for s, paths in sorted(p.get("stages", {}).items()):
                out.append(f"    stage {s}: {_path_list(paths)}")
        total = self.bytes_sharded + self.bytes_replicated
        out.append(f"  parameters: {self.params_sharded + self.params_replicated} tensors, {_bytes(total)}: "
                   f"sharded {self.params_sharded} ({_bytes(self.bytes_sharded)}), replicated "
                   f"{self.params_replicated} ({_bytes(self.bytes_replicated)}, {100 * self.replicated_fraction:.0f}%)")
        if self.bytes_per_device:
            per = sorted(set(self.bytes_per_device))
            out.append("  parameter bytes per rank: " + (_bytes(per[0]) if len(per) == 1 else
                       ", ".join(f"device {d}: {_bytes(b)}" for d, b in enumerate(self.bytes_per_device))))
        scope = "per micro-batch, summed over stages" if self.pipeline is not None else "per step"
        out.append(f"  collectives {scope}, per rank (payload bytes, traced input sizes):")
        out.append(f"    forward:  {_calls_line(self.collectives('forward'), detail=True)}")
        out.append(f"    backward: {_calls_line(self.collectives('backward'), detail=True)}")
        if self.recompute:
            out.append(f"    recomputed in backward (at most): {_calls_line(self.collectives('recompute'), detail=True)}")
        if self.dp_size > 1:
            out.append(f"    data-parallel gradient all-reduce: {_bytes(self.dp_grad_bytes)} per step "
                       f"(in buckets, across {self.dp_size} replicas)")
        out.append("  modules (ops split/all, subtree; parameters sharded | replicated, subtree; how its own ops split):")
        out.extend(_module_lines(self.modules))
        if self.unannotated:
            out.append("  ops without a dimension annotation (run replicated; register_op gives one):")
            for u in self.unannotated:
                out.append(f"    {u.target} x{u.count}: {u.where}")
        return "\n".join(out) + "\n"


# -- text helpers -----------------------------------------------------------------------------------

def _bytes(n: float) -> str:
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def _calls_line(per_kind: Dict[str, Tuple[int, int]], detail: bool = False) -> str:
    calls = sum(c for c, _ in per_kind.values())
    nbytes = sum(b for _, b in per_kind.values())
    if not calls:
        return "none"
    head = f"{calls} calls, {_bytes(nbytes)}"
    if not detail:
        return head
    return head + " (" + "; ".join(f"{k} x{c} {_bytes(b)}" for k, (c, b) in sorted(per_kind.items())) + ")"


def _path_list(paths: List[str]) -> str:
    names = _collapse_names(list(paths))
    return ", ".join(names[:6]) + (f", +{len(names) - 6} more" if len(names) > 6 else "")


def _collapse_names(paths: List[str]) -> List[str]:
    out: List[str] = []
    i = 0
    while i < len(paths):
        m = re.fullmatch(r"(.*?)(\d+)", paths[i] or "")
        j = i + 1
        if m:
            while j < len(paths) and paths[j] == f"{m.group(1)}{int(m.group(2)) + (j - i)}":
                j += 1
        out.append(paths[i] or "<root>" if j == i + 1 else f"{paths[i]}..{paths[j - 1]}")
        i = j
    return out


def _ops_text(ops: List[OpSplit]) -> str:
    split = [o for o in ops if o.dim is not None]
    rep = sum(o.count for o in ops if o.dim is None)
    if not split:
        return "replicated" if rep else ""
    merged: Dict[str, int] = {}
    for o in split:
        key = f"{o.op}[{o.dim}]"
        merged[key] = merged.get(key, 0) + o.count
    parts = [k + (f"x{c}" if c > 1 else "") for k, c in merged.items()]
    text = " ".join(parts[:3]) + (f" +{len(parts) - 3} more" if len(parts) > 3 else "")
    return text + (f"; {rep} replicated" if rep else "")


class _Tree:
    def __init__(self, name: str, report: Optional[ModuleReport]):
        self.name, self.report, self.children = name, report, []  # type: ignore[var-annotated]

    def totals(self) -> Tuple[int, int, int, int, int, int]:
        """(ops split, ops, params sharded, bytes sharded, params replicated, bytes replicated) of the subtree."""
        r = self.report
        acc = [r.split_ops, r.num_ops, r.params_sharded, r.bytes_sharded, r.params_replicated,
               r.bytes_replicated] if r else [0] * 6
        for c in self.children:
            acc = [a + b for a, b in zip(acc, c.totals())]
        return tuple(acc)  # type: ignore[return-value]

    def signature(self) -> tuple:
        r = self.report
        own = (r.type, tuple((o.op, o.dim, o.count) for o in r.ops), r.params_sharded, r.params_replicated,
               r.bytes_sharded, r.bytes_replicated) if r else None
        return own, tuple((c.name, c.signature()) for c in self.children)


def _tree(modules: List[ModuleReport]) -> _Tree:
    """Modules as a tree; children in the order the report lists them (the order they ran)."""
    root = _Tree("", None)
    nodes = {m.path: _Tree(m.path, m) for m in modules if m.path}
    nodes[""] = root
    for m in modules:
        if m.path == "":
            root.report = m
            continue
        parent_path = m.path.rpartition(".")[0]
        while parent_path and parent_path not in nodes:  # a parent with neither ops nor parameters
            parent_path = parent_path.rpartition(".")[0]
        node = nodes[m.path]
        node.name = m.path[len(parent_path) + 1:] if parent_path else m.path
        nodes[parent_path].children.append(node)
    return root


def _module_lines(modules: List[ModuleReport]) -> List[str]:
    rows: List[Tuple[str, str, str, str, str]] = []

    def visit(node: _Tree, depth: int, label: str) -> None:
        split, nops, ps, bs, pr, br = node.totals()
        r = node.report
        kind = r.type if r else ""
        own = _ops_text(r.ops) if r else ""
        params = f"{ps} ({_bytes(bs)}) | {pr} ({_bytes(br)})" if ps + pr else "-"
        how = (own if not node.children else f"own: {own}") if own else ""
        rows.append(("  " * depth + label, kind, f"{split}/{nops}", params, how))
        children = node.children
        i = 0
        while i < len(children):
            c = children[i]
            j = i + 1
            m = re.fullmatch(r"(|.*\.)(\d+)", c.name)
            if m:  # collapse identical consecutive layers: h.0..h.11
                while j < len(children) and children[j].name == f"{m.group(1)}{int(m.group(2)) + (j - i)}" \
                        and children[j].signature() == c.signature():
                    j += 1
            lab = c.name if j == i + 1 else f"{c.name}..{children[j - 1].name} (x{j - i}, each)"
            visit(c, depth + 1, lab)
            i = j

    root = _tree(modules)
    visit(root, 0, "<root>")
    widths = [max(len(r[k]) for r in rows) for k in range(4)]
    return ["    " + f"{a:<{widths[0]}}  {b:<{widths[1]}}  {c:>{widths[2]}}  {d:<{widths[3]}}  {e}".rstrip()
            for a, b, c, d, e in rows]
