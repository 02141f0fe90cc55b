"""The SPMD solver: one choice per op minimising estimated time under the memory limit.

An integer linear program solved exactly by HiGHS through ``scipy.optimize.milp`` (installs
from the package index, no external binary): a binary x[op, choice] per op (one choice each)
and, per producer/consumer edge, a continuous y[a, b] >= 0 whose marginals equal the two ops'
x (so y is the product of the choices when x is integral); minimise sum(time * x) +
sum(comm * y) subject to sum(mem * x) + sum(kept copies * y) <= limit. Tied layers share variables (costs summed).
HiGHS stops at `time_limit`; its best plan so far is used then, and without one the solver
falls back to the best of "all replicated" and a greedy descent (documented in docs/autodist.md).
"""
from __future__ import annotations

import time as _time
from dataclasses import dataclass
from typing import Dict, List, Optional

import numpy as np

from nnscaler.ir import ConfigError

from .cost_model import Problem

__all__ = ["Solution", "solve", "NoPlanFits", "size_text"]


def size_text(nbytes: float) -> str:
    """Bytes as GB (mem_constraint's unit), with MB alongside for small sizes."""
    gb = nbytes / 1024 ** 3
    return f"{gb:.3f} GB" if gb >= 0.1 else f"{gb:.6f} GB ({nbytes / 1024 ** 2:.2f} MB)"


class NoPlanFits(ConfigError):
    """No plan fits the memory limit; the message gives the smallest memory found (`smallest`,
    bytes per device)."""

    def __init__(self, message: str, smallest: Optional[float] = None):
        super().__init__(message)
        self.smallest = smallest


@dataclass
class Solution:
    pick: List[int]  # choice index per op of the problem
    time: float  # estimated seconds per step
    mem: float  # estimated bytes per device (without transient buffers)
    method: str  # "milp" | "milp (time limit)" | "greedy"
    seconds: float  # search time


def solve(problem: Problem, mem_limit: Optional[float] = None, tie: Optional[Dict[int, int]] = None,
          time_limit: float = 10.0) -> Solution:
    start = _time.perf_counter()
    tie = tie or {i: i for i in range(len(problem.ops))}
    reps = sorted(set(tie.values()))
    slot = {r: k for k, r in enumerate(reps)}
    nch = [len(problem.ops[r].choices) for r in reps]
    time_c = [np.zeros(c) for c in nch]
    mem_c = [np.zeros(c) for c in nch]
    for i, op in enumerate(problem.ops):
        s = slot[tie[i]]
        time_c[s] += op.time
        mem_c[s] += op.mem
    pair: Dict[tuple, np.ndarray] = {}
    pair_mem: Dict[tuple, np.ndarray] = {}
    for e in problem.edges:
        a, b = slot[tie[e.u]], slot[tie[e.v]]
        mem = e.mem if e.mem is not None else np.zeros_like(e.cost)
        if a == b:
            time_c[a] += np.diag(e.cost)
            mem_c[a] += np.diag(mem)
        elif (a, b) in pair:
            pair[(a, b)] = pair[(a, b)] + e.cost
            pair_mem[(a, b)] = pair_mem[(a, b)] + mem
        else:
            pair[(a, b)] = e.cost.copy()
            pair_mem[(a, b)] = mem.copy()
    budget = None if mem_limit is None else mem_limit - problem.const_mem
    pick_rep, method = _milp(nch, time_c, mem_c, pair, pair_mem, budget, time_limit)
    if pick_rep is None:
        pick_rep, method = _greedy(nch, time_c, mem_c, pair, pair_mem, budget), "greedy"
    if pick_rep is None:
        smallest = problem.const_mem + sum(float(m.min()) for m in mem_c)
        raise NoPlanFits(f"autodist: no plan fits mem_constraint = {size_text(mem_limit)} per device; the "
                         f"smallest plan found needs {size_text(smallest)} (before transient buffers). Raise "
                         f"mem_constraint, use more devices (plan_ngpus), set use_zero, recompute_modules, or a "
                         f"pipeline (pipeline_pivots)", smallest)
    pick = [pick_rep[slot[tie[i]]] for i in range(len(problem.ops))]
    t, m = problem.evaluate(pick)
    return Solution(pick, t, m, method, _time.perf_counter() - start)


def _milp(nch, time_c, mem_c, pair, pair_mem, budget, time_limit):
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix
    offs = np.concatenate([[0], np.cumsum(nch)]).astype(int)
    nx = int(offs[-1])
    cost = [np.concatenate(time_c)] if nx else [np.zeros(0)]
    rows, cols, vals, lo, hi = [], [], [], [], []
    r = 0
    for s, c in enumerate(nch):  # one choice per op
        for k in range(c):
            rows.append(r); cols.append(offs[s] + k); vals.append(1.0)
        lo.append(1.0); hi.append(1.0); r += 1
    ny = 0
    y_mem = []  # (column, bytes) of the pair variables that hold memory
    for (a, b), mat in pair.items():
        base = nx + ny
        for i, j in zip(*np.nonzero(pair_mem[(a, b)])):
            y_mem.append((base + int(i) * mat.shape[1] + int(j), float(pair_mem[(a, b)][i, j])))
        ca, cb = mat.shape
        cost.append(mat.reshape(-1))
        for i in range(ca):  # sum_j y[i, j] = x[a, i]
            for j in range(cb):
                rows.append(r); cols.append(base + i * cb + j); vals.append(1.0)
            rows.append(r); cols.append(offs[a] + i); vals.append(-1.0)
            lo.append(0.0); hi.append(0.0); r += 1
        for j in range(cb):  # sum_i y[i, j] = x[b, j]
            for i in range(ca):
                rows.append(r); cols.append(base + i * cb + j); vals.append(1.0)
            rows.append(r); cols.append(offs[b] + j); vals.append(-1.0)
            lo.append(0.0); hi.append(0.0); r += 1
        ny += ca * cb
    if budget is not None:
        m = np.concatenate(mem_c)
        for k in range(nx):
            rows.append(r); cols.append(k); vals.append(float(m[k]))
        for col, b in y_mem:
            rows.append(r); cols.append(col); vals.append(b)
        lo.append(-np.inf); hi.append(float(budget)); r += 1
    nvar = nx + ny
    A = coo_matrix((vals, (rows, cols)), shape=(r, nvar)).tocsr()
    c = np.concatenate(cost)
    scale = max(float(np.abs(c).max()), 1e-12)
    integrality = np.concatenate([np.ones(nx), np.zeros(ny)])
    res = milp(c / scale, constraints=LinearConstraint(A, lo, hi), integrality=integrality,
               bounds=Bounds(np.zeros(nvar), np.ones(nvar)),
               options={"time_limit": float(time_limit), "disp": False})
    if res.x is None:
        return None, None
    x = res.x[:nx]
    pick = [int(np.argmax(x[offs[s]:offs[s + 1]])) for s in range(len(nch))]
    return pick, ("milp" if res.status == 0 else "milp (time limit)")


def _greedy(nch, time_c, mem_c, pair, pair_mem, budget):
    """Coordinate descent from the least-memory plan: change one op at a time while it helps."""
    pick = [int(np.argmin(m)) for m in mem_c]

    def total(p):
        return sum(float(t[k]) for t, k in zip(time_c, p)) + sum(float(m[p[a], p[b]]) for (a, b), m in pair.items())

    def memory(p):
        return sum(float(m[k]) for m, k in zip(mem_c, p)) + sum(float(m[p[a], p[b]]) for (a, b), m in pair_mem.items())

    if budget is not None and memory(pick) > budget:
        return None
    best = total(pick)
    improved = True
    while improved:
        improved = False
        for s, c in enumerate(nch):
            for k in range(c):
                if k == pick[s]:
                    continue
                trial = pick[:s] + [k] + pick[s + 1:]
                if budget is not None and memory(trial) > budget:
                    continue
                t = total(trial)
                if t < best - 1e-15:
                    pick, best, improved = trial, t, True
    return pick
