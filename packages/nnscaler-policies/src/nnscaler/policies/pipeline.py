"""Pipeline primitives: cut the graph into stages and give it a schedule.

    leads = pivot_leads(graph, "Block")          # ops where a module of class Block starts
    cut_stages(graph, 2, leads)                  # stage boundaries balanced over those ops
    schedule(graph, nmicros=4, scheduler="1f1b", pp_size=2, tp_size=1)
    for node in graph.nodes:                     # then place each op on its stage's devices
        for device, piece in zip(stage_devices(graph, node), replicate(graph, node, 1)): ...

A stage is a contiguous run of ops in program order (``Node.stage``); values that one stage
produces and a later one reads cross on point-to-point messages (codegen and runtime do that).
A stage never starts between an in-place write and the op producing the tensor it writes (through
views: `inplace_writes.write_spans`): `cut_stages` skips those boundaries, `stage` refuses them.
`schedule` stores a `nnscaler.ir.pipeline_plan.PipelinePlan` on ``graph.pipeline``; it validates
the schedule against the plan, so a schedule that cannot apply is refused here.
"""
from __future__ import annotations

import fnmatch
from typing import List, Optional, Sequence, Union

from nnscaler.ir import ConfigError
from nnscaler.ir import IRGraph, Node
from nnscaler.ir import PipelinePlan

from .inplace_writes import write_spans
from .plan import PlanError

__all__ = ["pivot_leads", "stage", "cut_stages", "schedule", "stage_devices", "op_weight"]


def _pivot_list(pivots: Union[str, Sequence[str]]) -> List[str]:
    if isinstance(pivots, str):
        items = [p.strip() for p in pivots.split(",")]
    elif isinstance(pivots, (list, tuple)) and all(isinstance(p, str) for p in pivots):
        items = [p.strip() for p in pivots]
    else:
        raise ConfigError(f"pipeline_pivots must be a comma-separated string of module class names or module "
                          f"paths (e.g. 'Block' or 'blocks.*'), got {pivots!r}")
    items = [p for p in items if p]
    if not items:
        raise ConfigError(f"pipeline_pivots {pivots!r} names no module: give module class names or paths, "
                          f"e.g. 'Block'")
    return items


def _matches(path: str, cls: str, pivot: str) -> bool:
    return cls == pivot or cls.rsplit(".", 1)[-1] == pivot or _path_glob(path, pivot)


def _path_glob(path: str, pattern: str) -> bool:
    """Glob on module paths, one dotted segment at a time: ``blocks.*`` matches ``blocks.0`` but
    not ``blocks.0.attn`` (whose start would be a cut point inside a block)."""
    parts, pats = path.split("."), pattern.split(".")
    return len(parts) == len(pats) and all(fnmatch.fnmatchcase(a, b) for a, b in zip(parts, pats))


def pivot_leads(graph: IRGraph, pivots: Union[str, Sequence[str]]) -> List[int]:
    """Indices of the ops where a module matching a pivot starts (its first op), in order.

    A pivot is a module class name (``Block``), a dotted class (``mypkg.model.Block``) or a glob
    on module paths matched segment by segment (``blocks.*``: ``blocks.0``, not ``blocks.0.attn``).
    Raises ConfigError when no module matches.
    """
    items = _pivot_list(pivots)
    seen, leads = set(), []
    for idx, node in enumerate(graph.nodes):
        parts = node.module_path.split(".") if node.module_path else []
        for k in range(1, len(parts) + 1):
            path = ".".join(parts[:k])
            if path in seen:
                continue
            cls = graph.module_types.get(path, "")
            if any(_matches(path, cls, p) for p in items):
                seen.add(path)
                if idx not in leads:
                    leads.append(idx)
    if not leads:
        classes = sorted({c.rsplit(".", 1)[-1] for p, c in graph.module_types.items() if p})
        raise ConfigError(f"pipeline_pivots {pivots!r} matches no module of {graph.module_class}; its module "
                          f"classes are: {', '.join(classes) or 'none'} (or give module path globs)")
    return leads


def stage(graph: IRGraph, leads: Sequence[Union[int, Node]]) -> List[List[Node]]:
    """Cut the graph before each lead op: stage 0 runs up to the first lead, stage k starts at
    lead k-1. Leads are op indices or Nodes, strictly increasing, none of them the first op.
    Sets ``Node.stage``; returns the stages' op lists."""
    index = {id(n): i for i, n in enumerate(graph.nodes)}
    cuts = []
    for lead in leads:
        i = index.get(id(lead)) if isinstance(lead, Node) else lead
        if not isinstance(i, int) or isinstance(i, bool) or not 0 < i < len(graph.nodes):
            raise PlanError(f"stage lead {lead!r} is not an op of the graph after its first op "
                            f"(indices 1..{len(graph.nodes) - 1})")
        cuts.append(i)
    if cuts != sorted(set(cuts)):
        raise PlanError(f"stage leads must be strictly increasing op indices, got {cuts}")
    for first, last, write in write_spans(graph):
        inside = [c for c in cuts if first < c <= last]
        if inside:
            raise PlanError(
                f"a stage would start at op {inside[0]} ({graph.nodes[inside[0]].target}), between op {first} "
                f"({graph.nodes[first].target}) and the in-place write that fills what it produced, op {last}: "
                f"{write.describe()}; the next stage would write into a received copy. Cut at op {first} or "
                f"before, or after op {last}")
    bounds = [0, *cuts, len(graph.nodes)]
    stages = []
    for s in range(len(bounds) - 1):
        ops = graph.nodes[bounds[s]:bounds[s + 1]]
        for node in ops:
            node.stage = s
        stages.append(ops)
    return stages


def op_weight(node: Node) -> float:
    """The balancing weight of an op: 1, or 0.1 for ops that only reshape, index or query shapes."""
    light = ("view", "reshape", "size", "numel", "getattr", "getitem", "transpose", "permute",
             "contiguous", "split", "chunk", "unsqueeze", "squeeze", "flatten", "expand")
    return 0.1 if node.short_name.strip("_") in light else 1.0


def cut_stages(graph: IRGraph, nstages: int, candidates: Optional[Sequence[int]] = None) -> List[List[Node]]:
    """Cut the graph into `nstages` stages minimising the heaviest stage's op weight
    (`op_weight`), cutting only before ops in `candidates` (indices; default: any op). Exact,
    O(nstages * n log n). Sets ``Node.stage``; returns the stages."""
    if isinstance(nstages, bool) or not isinstance(nstages, int) or nstages < 1:
        raise ConfigError(f"pipeline_nstages must be a positive integer, got {nstages!r}")
    n = len(graph.nodes)
    inside = {c for first, last, _ in write_spans(graph) for c in range(first + 1, last + 1)}
    cand = sorted({c for c in (range(1, n) if candidates is None else candidates) if 0 < c < n} - inside)
    if len(cand) < nstages - 1:
        where = "op boundaries" if candidates is None else "pivot module starts after the first op"
        raise ConfigError(f"cannot cut {graph.module_class} into pipeline_nstages={nstages} stages: it has only "
                          f"{len(cand)} {where} to cut at (need {nstages - 1}); lower pipeline_nstages"
                          + ("" if candidates is None else " or give more pipeline_pivots"))
    prefix = [0.0]
    for node in graph.nodes:
        prefix.append(prefix[-1] + op_weight(node))
    if nstages == 1:
        return stage(graph, [])
    points = [0, *cand]  # where a stage may start (stage 0 starts at op 0)
    inf = float("inf")
    # f[k][j]: least max stage weight of stages 0..k-1 covering ops [0, points[j]), j >= 1
    f = [[inf] * len(points) for _ in range(nstages)]
    back = [[0] * len(points) for _ in range(nstages)]
    for j in range(1, len(points)):
        f[1][j] = prefix[points[j]]
    for k in range(2, nstages):
        for j in range(k, len(points)):
            # over i in [k-1, j): f[k-1][i] grows with i, the last stage's weight shrinks, so the
            # best split is where they cross: binary search, then look at both neighbours
            lo, hi = k - 1, j - 1
            while lo < hi:
                mid = (lo + hi) // 2
                if f[k - 1][mid] >= prefix[points[j]] - prefix[points[mid]]:
                    hi = mid
                else:
                    lo = mid + 1
            for i in {max(k - 1, lo - 1), lo}:
                w = max(f[k - 1][i], prefix[points[j]] - prefix[points[i]])
                if w < f[k][j]:
                    f[k][j], back[k][j] = w, i
    last = min(range(1, len(points)), key=lambda j: (max(f[nstages - 1][j], prefix[n] - prefix[points[j]]), j))
    leads, j = [], last
    for k in range(nstages - 1, 0, -1):
        leads.append(points[j])
        j = back[k][j]
    return stage(graph, sorted(leads))


def schedule(graph: IRGraph, nmicros: int, scheduler: str = "1f1b", pp_size: Optional[int] = None,
             tp_size: int = 1) -> PipelinePlan:
    """Run the staged graph as a pipeline of `nmicros` micro-batches with `scheduler` on `pp_size`
    pipeline devices (default: one per stage) of `tp_size` plan devices each. Stores and returns
    the PipelinePlan; raises ConfigError when the schedule cannot apply."""
    unstaged = [n for n in graph.nodes if n.stage is None]
    if unstaged:
        raise PlanError(f"op {unstaged[0].describe()} has no pipeline stage: call stage() or cut_stages() first")
    nstages = max(n.stage for n in graph.nodes) + 1
    empty = sorted(set(range(nstages)) - {n.stage for n in graph.nodes})
    if empty:
        raise PlanError(f"pipeline stages {empty} have no ops")
    plan = PipelinePlan(nstages, nmicros, scheduler, nstages if pp_size is None else pp_size, tp_size)
    graph.pipeline = plan
    return plan


def stage_devices(graph: IRGraph, node: Node) -> tuple:
    """The plan devices that run `node`'s pieces (its stage's home pipeline device)."""
    if graph.pipeline is None or node.stage is None:
        raise PlanError(f"op {node.describe()} is not in a scheduled pipeline: call stage() and schedule() first")
    return graph.pipeline.home_devices(node.stage)
