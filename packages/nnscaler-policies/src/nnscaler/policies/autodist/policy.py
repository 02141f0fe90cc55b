"""`autodist`: the plan search. Profiles the ops, prices every choice, solves the SPMD plan
(and, with `pipeline_pivots`, the pipeline), applies the best plan that fits the memory limit,
and can save, load and print it. Registered as ``pas_policy="autodist"``."""
from __future__ import annotations

import importlib.util
import math
import os
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from nnscaler.ir import EXPERT_DIM, RING_DIM, ROUTED_EXPERTS, SDPA, IRGraph, warn_user

from ..builtin._nothing_split import PolicyWarning
from ..builtin._spread import replicate_over_unit, split_over_unit
from ..builtin.cp import split_ring
from ..builtin.ep import split_experts
from ..pipeline import pivot_leads, schedule, stage
from ..recompute import recompute_modules
from ..registry import register_policy
from .comm_profile import measured_comm_model
from .config import KEYS, AutodistConfig
from .constraints import load_constraints
from .cost_model import Problem, build_problem, gathered_bytes
from .cpu_sharing import cpu_scale, shared_cores
from .graph_timing import calibration
from .layers import tie_layers
from .op_keys import op_keys
from .op_profile import memory_bandwidth, optimizer_rate, optimizer_tensor_cost, profile_graph
from .pipeline_solver import StagePlan, cut_pipeline, shared_across_stages
from .pipeline_time import PipelineTiming
from .plan_file import OpRecord, PlanRecord, StalePlanError, load_plan, op_shapes, save_plan
from .report import format_plan
from .spmd_solver import NoPlanFits, Solution, size_text, solve

__all__ = ["autodist", "AutodistWarning", "search"]


class AutodistWarning(PolicyWarning):
    """Something autodist accepted but cannot honour fully (e.g. apex absent)."""


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def local_processes(cfg: AutodistConfig) -> int:
    """The job's processes on this machine: LOCAL_WORLD_SIZE, else runtime_ngpus."""
    return int(os.environ.get("LOCAL_WORLD_SIZE") or cfg.runtime_ngpus)


def _transient(problem: Problem, pick: List[int], coef: float) -> float:
    """The plan's transient buffers: `coef` times its two largest op outputs, plus under ZeRO-3 the
    units gathered at once (`gathered_bytes`)."""
    sizes = sorted((op.out_bytes[c] for op, c in zip(problem.ops, pick)), reverse=True)
    return coef * sum(sizes[:2]) + gathered_bytes(problem, pick)


class _Search:
    def __init__(self, graph: IRGraph, cfg: AutodistConfig):
        self.graph, self.cfg = graph, cfg
        self.device = _device()
        self.op_times, self.db = profile_graph(graph, device=self.device, re_profile=cfg.re_profile,
                                               repeats=cfg.profile_repeats)
        self.calibration, self.uncalibrated = calibration(graph, self.op_times, self.db, self.device, cfg.re_profile)
        # how much slower a rank runs beside the job's other local processes (CPU; 1 on GPUs)
        self.procs, self.threads = local_processes(cfg), torch.get_num_threads()
        self.scale, self.scale_note = cpu_scale(graph, self.db, self.device, self.procs, self.threads, cfg.re_profile)
        shapes = [graph.value(spec.value).shape or () for spec in graph.tensor_specs() if spec.requires_grad]
        self.opt_rate = optimizer_rate(self.db, self.device, cfg.re_profile, shapes) * self.scale
        self.opt_tensor = optimizer_tensor_cost(self.db, self.device, cfg.re_profile) * self.scale
        self.copy_rate = 2 / memory_bandwidth(self.device) * self.scale if cfg.use_zero else 0.0
        factor = self.scale * self.calibration
        if factor != 1.0:
            self.op_times = {k: (f * factor, b * factor) for k, (f, b) in self.op_times.items()}
        self.problems: Dict[int, Problem] = {}

    def pipeline_timing(self) -> PipelineTiming:
        fwd = sum(f for f, _ in self.op_times.values())
        total = fwd + sum(b for _, b in self.op_times.values())
        return PipelineTiming(fwd_share=fwd / total if total > 0 else 1 / 3, scale=self.scale,
                              threads=self.procs * self.threads,
                              cores=shared_cores() if self.device.startswith("cpu") else None,
                              scheduler=self.cfg.pipeline_scheduler)

    def problem(self, tp: int, comm) -> Problem:
        if tp not in self.problems:
            cfg = self.cfg
            allowed = load_constraints(cfg.partition_constraints_path, self.graph, tp) \
                if cfg.partition_constraints_path else {}
            if cfg.max_partition_degree is not None and tp > cfg.max_partition_degree:
                allowed = {node.id: ["R"] for node in self.graph.nodes}
            self.problems[tp] = build_problem(self.graph, tp, self.op_times, comm, cfg, allowed,
                                              opt_rate=self.opt_rate, copy_rate=self.copy_rate,
                                              opt_tensor=self.opt_tensor)
        return self.problems[tp]

    def spmd(self, problem: Problem, limit: Optional[float]) -> Solution:
        """Solve, then tighten the limit by the transient buffers until the plan fits with them."""
        tie = tie_layers(problem)
        budget = limit
        for _ in range(4):
            sol = solve(problem, budget, tie, self.cfg.solver_time_limit)
            extra = _transient(problem, sol.pick, self.cfg.transient_mem_coef)
            if limit is None or sol.mem + extra <= limit:
                return sol
            budget = limit - extra
        raise NoPlanFits(f"autodist: no plan fits mem_constraint = {size_text(limit)} per device with its "
                         f"transient buffers (transient_mem_coef = {self.cfg.transient_mem_coef}); the best found "
                         f"needs {size_text(sol.mem + extra)}", sol.mem + extra)


# The per-stage SPMD plans are first the fastest ones; when no cut of them fits the limit, the
# whole graph's plan is searched again under a budget of the limit times the stages (each stage
# holds about 1/k of it), then tighter budgets, until a cut fits.
_STAGE_BUDGETS = (1.0, 0.75, 0.5, 0.35, 0.25)


def _pipeline_tail(graph: IRGraph, problem: Problem, cfg: AutodistConfig, comm) -> Callable[[Sequence[int]], float]:
    """Seconds a pipelined step spends after its schedule, for a cut with stage `leads`: the SPMD
    plan's step-level costs, the all-reduce of each tensor read in several stages across them
    (and the data-parallel units), and the two broadcasts of the step's outputs over the plan's devices (a tree of messages)."""
    finals = 2 * max(1, math.ceil(math.log2(cfg.plan_ngpus))) * comm.time("p2p", 8 * 15, 2)

    def tail(leads: Sequence[int]) -> float:
        # over the holders in every data-parallel unit (runtime/pipeline_grads.py: one group)
        shared = sum(comm.time("all_reduce", b, n * cfg.dp_size) for b, n in shared_across_stages(graph, leads))
        return problem.const_time * cfg.nmicros + shared + finals
    return tail


def _pipeline(s: "_Search", graph: IRGraph, problem: Problem, k: int, leads, limit, comm):
    """(SPMD solution on the stage devices, best cut into k stages, or None for both; the least
    memory per device of the cuts tried)."""
    p2p = lambda b: comm.time("p2p", b, 2)  # noqa: E731
    tail = _pipeline_tail(graph, problem, s.cfg, comm)
    budgets = [None] + ([limit * k * f for f in _STAGE_BUDGETS] if limit is not None else [])
    least = None
    for budget in budgets:
        try:
            sol = s.spmd(problem, budget)
        except NoPlanFits:
            break
        cut = cut_pipeline(graph, problem, sol, k, leads, s.cfg.nmicros, limit, p2p, s.pipeline_timing(), tail,
                           s.cfg.transient_mem_coef)
        if cut is not None:
            return sol, cut, max(cut.stage_mem)
        free = cut_pipeline(graph, problem, sol, k, leads, s.cfg.nmicros, None, p2p,
                            transient_coef=s.cfg.transient_mem_coef)
        if free is not None:
            least = max(free.stage_mem) if least is None else min(least, max(free.stage_mem))
    return None, None, least


def search(graph: IRGraph, cfg: AutodistConfig) -> Tuple[PlanRecord, Dict[int, str], Optional[StagePlan]]:
    """Find the plan; returns the record, node id -> choice label, and the pipeline cut if any."""
    start = time.perf_counter()
    n = cfg.plan_ngpus
    s = _Search(graph, cfg)
    leads = None
    if cfg.pipeline_pivots and cfg.pipeline_nstages != 1:
        leads = pivot_leads(graph, cfg.pipeline_pivots)
    stage_counts = [1] if leads is None else (
        [cfg.pipeline_nstages] if cfg.pipeline_nstages != "auto" else [k for k in range(1, n + 1) if n % k == 0])
    if leads is not None and cfg.pipeline_nstages == "auto" and n > 1:
        stage_counts = [k for k in stage_counts if k == 1 or len([c for c in leads if c > 0]) >= k - 1]
    maxdeg = cfg.max_partition_degree or n
    sizes = {n // k for k in stage_counts} | {cfg.dp_size, cfg.runtime_ngpus} | ({2} if leads else set())
    sizes |= {cfg.zero_group, cfg.dp_size // cfg.zero_group} - {1}  # ZeRO's group and its cross group
    comm = measured_comm_model(sizes, s.device, cfg.re_profile, cfg.comm_profile, world=s.procs, load=s.scale)
    limit = cfg.mem_limit_bytes
    best = None  # (step time, nstages, problem, solution, stage plan)
    smallest = []  # (bytes per device, how) of the least-memory plans that did not fit
    for k in stage_counts:
        tp = n // k
        if k > 1 and tp > maxdeg:
            continue
        problem = s.problem(tp, comm)
        try:
            if k == 1:
                sol = s.spmd(problem, limit)
                cand = (cfg.nmicros * sol.time, k, problem, sol, None)
            else:
                sol, cut, least = _pipeline(s, graph, problem, k, leads, limit, comm)
                if cut is None:
                    if least is not None:
                        smallest.append((least, f"as a {k}-stage pipeline, transient buffers included"))
                    continue
                cand = (cut.step_time, k, problem, sol, cut)
        except NoPlanFits as e:
            if e.smallest is not None:
                smallest.append((e.smallest, "without a pipeline, before transient buffers"))
            continue
        if best is None or cand[0] < best[0]:
            best = cand
    if best is None:
        least, how = min(smallest) if smallest else (None, "")
        found = (f"; the smallest plan found needs {size_text(least)} ({how})"
                 if least is not None else "")
        raise NoPlanFits(f"autodist: no plan fits mem_constraint = {size_text(limit)} per device for "
                         f"{graph.module_class}{found}. Raise mem_constraint, use more devices (plan_ngpus), set "
                         f"use_zero, recompute_modules, or let it pipeline (pipeline_pivots)", least)
    step, k, problem, sol, cut = best
    keys = op_keys(graph)
    labels = {op.node.id: op.choices[c].label for op, c in zip(problem.ops, sol.pick)}
    stage_of = {}
    if cut is not None:
        bounds = [0, *cut.leads, len(graph.nodes)]
        for st in range(len(bounds) - 1):
            for node in graph.nodes[bounds[st]:bounds[st + 1]]:
                stage_of[node.id] = st
    per_op = {op.node.id: (op.time[c], op.mem[c]) for op, c in zip(problem.ops, sol.pick)}
    ops = [OpRecord(keys[node.id], node.target, node.module_path, labels.get(node.id, "R"), op_shapes(graph, node),
                    stage_of.get(node.id), *per_op.get(node.id, (0.0, 0.0)))
           for node in graph.nodes]
    if cut is not None:  # the stage that needs the most, its own transient buffers included
        top = max(range(len(cut.stage_mem)), key=cut.stage_mem.__getitem__)
        mem, transient = cut.stage_mem[top], cut.stage_transient[top]
    else:
        transient = _transient(problem, sol.pick, cfg.transient_mem_coef)
        mem = sol.mem + transient
    estimate = {"time_s": step, "mem_bytes": mem, "transient_bytes": transient, "search_s": time.perf_counter() - start,
                "solver_s": sol.seconds, "profiled_ops": s.db.misses, "cached_ops": s.db.hits, "compute_scale": s.scale,
                "compute_calibration": s.calibration}
    if s.uncalibrated:
        estimate["not_calibrated"] = s.uncalibrated
    if s.scale_note:
        estimate["cpu_scale_note"] = s.scale_note
    if limit is not None:
        estimate["mem_limit_bytes"] = limit
    pipeline = None if cut is None else {"nstages": k, "tp_size": cut.tp_size, "nmicros": cfg.nmicros,
                                         "scheduler": cfg.pipeline_scheduler}
    record = PlanRecord(graph.module_class, n, ops, estimate, pipeline, cfg.task_name, sol.method)
    return record, labels, cut


def apply_record(graph: IRGraph, record: PlanRecord) -> IRGraph:
    """Give every op of `graph` its pieces as `record` says (stages and schedule included)."""
    keys = op_keys(graph)
    by_key = {o.key: o for o in record.ops}
    p = record.pipeline
    if p is not None:
        leads, prev = [], 0
        for i, node in enumerate(graph.nodes):
            st = by_key[keys[node.id]].stage
            if st is not None and st != prev:
                leads.append(i)
                prev = st
        stage(graph, leads)
        schedule(graph, p["nmicros"], p["scheduler"], p["nstages"], p["tp_size"])
    for node in graph.nodes:
        devices = graph.pipeline.home_devices(node.stage) if graph.pipeline is not None else tuple(range(record.plan_ngpus))
        choice = by_key[keys[node.id]].choice
        if choice == "R" or len(devices) == 1:
            replicate_over_unit(graph, node, len(devices), devices)
        elif choice == EXPERT_DIM and node.target == ROUTED_EXPERTS:
            split_experts(graph, node, devices)
        elif choice == RING_DIM and node.target == SDPA:
            split_ring(graph, node, devices)
        else:
            split_over_unit(graph, node, choice, len(devices), devices)
    return graph


def _check_obeys(graph: IRGraph, record: PlanRecord, cfg: AutodistConfig) -> None:
    """A loaded plan must obey the constraints file as a searched one does."""
    tp = record.pipeline["tp_size"] if record.pipeline else record.plan_ngpus
    allowed = load_constraints(cfg.partition_constraints_path, graph, tp)
    keys = op_keys(graph)
    by_key = {o.key: o for o in record.ops}
    broken = [f"{keys[node.id]} is {by_key[keys[node.id]].choice!r}, allowed {allowed[node.id]}"
              for node in graph.nodes if node.id in allowed and by_key[keys[node.id]].choice not in allowed[node.id]]
    if broken:
        raise StalePlanError(f"autodist plan {cfg.load_plan_path} breaks the partition constraints "
                             f"{cfg.partition_constraints_path}: {'; '.join(broken[:5])}"
                             + (f" (and {len(broken) - 5} more)" if len(broken) > 5 else "")
                             + ". Search again with the constraints (drop load_plan_path), or change the constraints")


@register_policy("autodist", keys=KEYS, pipelines=True)
def autodist(graph: IRGraph, compute_config) -> IRGraph:
    cfg = AutodistConfig.from_compute_config(compute_config)
    if cfg.use_apex_fused_adam_v2 and importlib.util.find_spec("apex") is None:
        warn_user("autodist: use_apex_fused_adam_v2 is set but apex is not installed; the plan is searched for a "
                  "plain Adam (same optimizer-state memory)", AutodistWarning)
    if cfg.recompute_modules:
        recompute_modules(graph, cfg.recompute_modules)
    if cfg.load_plan_path:
        record = load_plan(cfg.load_plan_path, graph, cfg.plan_ngpus)
        if cfg.partition_constraints_path:
            _check_obeys(graph, record, cfg)
    else:
        record, _, _ = search(graph, cfg)
    apply_record(graph, record)
    if cfg.save_plan_path:
        save_plan(record, cfg.save_plan_path)
    if cfg.verbose:
        print(format_plan(record), flush=True)
    graph.autodist_plan = record  # for callers that want the estimate (bench, tests)
    return graph
