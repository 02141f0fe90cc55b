"""Calibrating a cluster description from one measured step (``nnscaler plan estimate
--calibrate-step-seconds S``; docs/autodist.md, "Long context", calibration).

The cost model prices today's kernels (`costs.EFFICIENCY`). Software that reaches less of the peak
(older cuBLAS, attention without fused kernels, a framework's overheads) runs slower than that: one
factor f scales the matmul and attention efficiencies together (the compute kernels; memory-bound
ops and links are left as described) until the plan's predicted step equals the measured one. The
result is the ``efficiency`` mapping to put in the cluster YAML; the step is monotone in f, so a
bisection finds it.
"""
from __future__ import annotations

import dataclasses
import math

from nnscaler.ir import ConfigError

from .cluster import Cluster
from .costs import efficiency
from .model import ModelSpec
from .plan_cost import Plan, Workload, estimate_plan

__all__ = ["calibrate", "scaled"]

LOWEST = 1e-3  # the smallest factor tried: below it the step is not the kernels' doing


def scaled(cluster: Cluster, factor: float) -> Cluster:
    """`cluster` with its matmul and attention efficiencies times `factor` (memory-bound ops unchanged)."""
    eff = dict(cluster.efficiency)
    for kind in ("matmul", "attention"):
        eff[kind] = efficiency(cluster, kind) * factor
    return dataclasses.replace(cluster, efficiency=eff)


def calibrate(spec: ModelSpec, cluster: Cluster, work: Workload, plan: Plan, measured_s) -> dict:
    """The compute efficiencies that make `plan`'s predicted step `measured_s` seconds:
    ``{"measured_step_s", "estimated_step_s", "factor", "efficiency": {"matmul", "attention"}, "yaml"}``."""
    if isinstance(measured_s, bool) or not isinstance(measured_s, (int, float)) or not 0 < measured_s < math.inf:
        raise ConfigError(f"--calibrate-step-seconds must be a number of seconds > 0 (one measured step of the "
                          f"plan), got {measured_s!r}")

    def step(f: float) -> float:
        return estimate_plan(spec, scaled(cluster, f), work, plan).step_s

    hi = 1.0 / max(efficiency(cluster, "matmul"), efficiency(cluster, "attention"))  # both at most 1
    fastest, slowest = step(hi), step(LOWEST)
    if measured_s < fastest:
        raise ConfigError(f"--calibrate-step-seconds {measured_s:g}: faster than {plan.describe()} can run on this "
                          f"cluster with matmuls and attention at its full peak ({fastest:.4g} s); check that the "
                          f"plan (--fix) and --global-batch-tokens are the measured run's, and the cluster's peak "
                          f"and links")
    if measured_s > slowest:
        raise ConfigError(f"--calibrate-step-seconds {measured_s:g}: slower than {plan.describe()} at "
                          f"{LOWEST:g} x this cluster's compute efficiency ({slowest:.4g} s): what the step spends "
                          f"is not the kernels (stalls, I/O, a different plan); measure a steady-state step")
    lo = LOWEST
    for _ in range(60):  # bisect on a log scale: step(lo) >= measured >= step(hi)
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if step(mid) > measured_s else (lo, mid)
    factor = math.sqrt(lo * hi)
    eff = {k: round(efficiency(cluster, k) * factor, 4) for k in ("matmul", "attention")}
    return {"measured_step_s": float(measured_s), "estimated_step_s": step(1.0), "factor": factor,
            "efficiency": eff, "yaml": f"efficiency: {{matmul: {eff['matmul']:g}, attention: {eff['attention']:g}}}"}
