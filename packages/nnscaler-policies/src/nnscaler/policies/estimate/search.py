"""The search: every tensor (inside a node, dividing the heads), context (`context.cp_options`),
pipeline and data parallel degree of the whole cluster, with ZeRO (none, 1 or 3), micro-batch size
and recomputation, and for a mixture-of-experts model every expert-parallel degree dividing the
experts and dp (with context parallelism 1 or cp: the experts split over the cp ranks); the fastest plan
that fits wins, and the best plan of each other (tp, cp, pp, ep) family is kept with the reason it
lost."""
from __future__ import annotations

import dataclasses
import time
from typing import List, Optional

from nnscaler.ir import ConfigError

from .cluster import Cluster
from .context import check_cp, cp_options
from .costs import USABLE_MEMORY
from .model import ModelSpec
from .plan_cost import Estimate, Plan, Workload, estimate_plan

__all__ = ["NoPlanFitsCluster", "SearchResult", "candidates", "ep_options", "search", "why_lost", "zero_options"]

MICRO_BATCHES = (1, 2, 4, 8, 16, 32)
VIRTUAL = (1, 2, 4)  # pipeline stages per GPU (interleaved 1F1B beyond 1)


class NoPlanFitsCluster(ConfigError):
    """No plan of the search fits the described GPUs' memory; the message gives the smallest found."""


@dataclasses.dataclass
class SearchResult:
    best: Estimate
    runners_up: List[tuple]  # (Estimate, reason it lost), the best of each other (tp, cp, pp, ep) family
    evaluated: int
    search_s: float


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(spec: ModelSpec, cluster: Cluster, work: Workload, cp: Optional[int] = None):
    """Every plan the search prices; `cp`: only that context-parallel degree (else `cp_options`)."""
    seqs = work.sequences
    for tp in _divisors(cluster.gpus_per_node):
        if work.gpus % tp or spec.heads % tp or (spec.kv_heads % tp and tp % spec.kv_heads):
            continue
        for c in cp_options(work.seq, work.gpus // tp) if cp is None else [cp] * ((work.gpus // tp) % cp == 0):
            yield from _plans(spec, work, seqs, tp, c)


def _plans(spec: ModelSpec, work: Workload, seqs: int, tp: int, cp: int):
    for pp in _divisors(work.gpus // (tp * cp)):
        dp = work.gpus // (tp * cp * pp)
        if pp > spec.layers or seqs % dp:
            continue
        for b in MICRO_BATCHES:
            if (seqs // dp) % b:
                continue
            nmicros = seqs // (dp * b)
            for v in VIRTUAL:
                # interleaving: more than one stage per GPU, nmicros a multiple of pp (Megatron-LM's rule)
                if v > 1 and (pp == 1 or pp * v > spec.layers or nmicros % pp):
                    continue
                for ep in ep_options(spec, dp, cp):
                    for zero in zero_options(tp, pp, dp * cp):  # ZeRO shards over the dp·cp replicas
                        for recompute in (False, True):
                            yield Plan(tp, pp, dp, zero, b, recompute, v, ep=ep, cp=cp)


def ep_options(spec: ModelSpec, dp: int, cp: int = 1) -> List[int]:
    """Expert-parallel degrees: each divisor of dp that divides the routed experts (1 for a dense model);
    with cp > 1, 1 or cp (the cp policy splits the experts over all of its unit's ranks or none,
    ``ep_size``)."""
    if not spec.is_moe:
        return [1]
    return [e for e in ((1, cp) if cp > 1 else _divisors(dp)) if spec.experts % e == 0]


def zero_options(tp: int, pp: int, dp: int) -> List[int]:
    """ZeRO stages for a plan: none; with dp > 1 ZeRO-1 and ZeRO-3 (with pipelines too: each stage's
    parameters sharded over its dp ranks). One zero group over all of dp: `estimate_plan` prices
    `zero_ngroups`, but the search does not try it (a node-local group would change ZeRO-1's picks as
    much as ZeRO-3's)."""
    return [0] if dp <= 1 else [0, 1, 3]


def why_lost(loser: Estimate, best: Estimate, cluster: Cluster) -> str:
    """The reason `loser` is not the plan: memory, or the part of its step that grew most."""
    if not loser.fits:
        return (f"memory: needs {loser.memory_gb:.1f} GB, {cluster.gpu.memory_gb * USABLE_MEMORY:.1f} GB usable "
                f"per GPU")
    deltas = {"bubble": loser.bubble_s - best.bubble_s,
              "communication": loser.comm_s - best.comm_s,
              "compute": (loser.compute_s + loser.optimizer_s) - (best.compute_s + best.optimizer_s)}
    part, delta = max(deltas.items(), key=lambda kv: kv[1])
    if delta <= 0:
        return "ties the chosen plan"
    detail = {"compute": " (recomputation, smaller matmuls)" if loser.plan.recompute or loser.plan.tp != best.plan.tp
              else " (more ring steps)" if loser.plan.cp > best.plan.cp else ""}.get(part, "")
    return f"{part}: +{delta:.3g} s{detail}" if delta >= 1 else f"{part}: +{delta * 1e3:.3g} ms{detail}"


def search(spec: ModelSpec, cluster: Cluster, work: Workload, top: int = 8,
           fixed: Optional[dict] = None) -> SearchResult:
    """The fastest plan that fits; `fixed` pins plan fields (e.g. ``{"tp": 8, "pp": 16}``)."""
    start = time.perf_counter()
    fixed = fixed or {}
    _check_workload(spec, cluster, work)
    _check_fixed_ep(spec, fixed.get("ep"))
    if "cp" in fixed:
        check_cp(work.seq, fixed["cp"])
        if fixed["cp"] > 1 and fixed.get("ep", 1) not in (1, fixed["cp"]):
            raise ConfigError(f"--cp {fixed['cp']} with --ep {fixed['ep']}: with context parallelism the experts are "
                              f"split over the cp ranks (the cp policy's ep_size: all of them or none), so ep is cp or "
                              f"1; use --ep " + " or ".join(str(e) for e in ep_options(spec, 1, fixed["cp"])))
    best_fit: Optional[Estimate] = None
    smallest: Optional[Estimate] = None
    family_best = {}
    n = 0
    for plan in candidates(spec, cluster, work, cp=fixed.get("cp")):
        if fixed and any(getattr(plan, k) != v for k, v in fixed.items()):
            continue
        est = estimate_plan(spec, cluster, work, plan)
        n += 1
        if smallest is None or est.memory_bytes < smallest.memory_bytes:
            smallest = est
        if est.fits and (best_fit is None or est.step_s < best_fit.step_s):
            best_fit = est
        key = (plan.tp, plan.cp, plan.pp, plan.ep)
        old = family_best.get(key)
        if old is None or (est.fits, -est.step_s) > (old.fits, -old.step_s):
            family_best[key] = est
    if smallest is None:
        raise NoPlanFitsCluster(f"no plan splits this model over {work.gpus} GPUs (tensor parallel must divide "
                                f"the {spec.heads} heads and fit in a node of {cluster.gpus_per_node}, the data-parallel "
                                f"degree must divide the {work.sequences} sequences of a step"
                                + (", the context-parallel degree the GPUs tp leaves" if fixed.get("cp", 1) > 1 else "")
                                + (f", the expert-parallel degree dp (cp with context parallelism) and the {spec.experts} experts" if spec.is_moe
                                   else "")
                                + (f", and the fixed {fixed}" if fixed else "") + "); change --gpus or "
                                f"--global-batch-tokens")
    if best_fit is None:
        raise NoPlanFitsCluster(f"no plan fits {cluster.gpu.memory_gb:g} GB per GPU ({USABLE_MEMORY:.0%} usable): "
                                f"the smallest, {smallest.plan.describe()}, needs {smallest.memory_gb:.1f} GB; use "
                                f"more GPUs, GPUs with more memory, or a shorter --seq-len")
    chosen = (best_fit.plan.tp, best_fit.plan.cp, best_fit.plan.pp, best_fit.plan.ep)
    others = sorted((e for k, e in family_best.items() if k != chosen),
                    key=lambda e: (not e.fits, e.step_s))[:top]
    return SearchResult(best_fit, [(e, why_lost(e, best_fit, cluster)) for e in others], n,
                        time.perf_counter() - start)


def _check_workload(spec: ModelSpec, cluster: Cluster, work: Workload) -> None:
    for name, value in (("--gpus", work.gpus), ("--seq-len", work.seq), ("--global-batch-tokens", work.global_batch_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be a whole number >= 1, got {value!r}")
    if work.global_batch_tokens % work.seq:
        raise ConfigError(f"--global-batch-tokens ({work.global_batch_tokens}) must be a multiple of --seq-len "
                          f"({work.seq}): a step is whole sequences")
    imbalance = work.moe_imbalance
    if isinstance(imbalance, bool) or not isinstance(imbalance, (int, float)) or not 1 <= imbalance < float("inf"):
        raise ConfigError(f"--moe-imbalance must be a number >= 1 (the busiest expert-parallel rank's tokens over "
                          f"the mean; 1 is perfect balance), got {imbalance!r}")
    if work.gpus > cluster.gpus_per_node and work.gpus % cluster.gpus_per_node:
        raise ConfigError(f"--gpus ({work.gpus}) must fill whole nodes of {cluster.gpus_per_node} "
                          f"(gpus_per_node of {cluster.source or cluster.name})")


def _check_fixed_ep(spec: ModelSpec, ep) -> None:
    """A forced expert-parallel degree (``--ep``) must fit the model's experts."""
    if ep is None:
        return
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise ConfigError(f"--ep must be a whole number >= 1, got {ep!r}")
    if ep > 1 and not spec.is_moe:
        raise ConfigError(f"--ep {ep} needs a mixture-of-experts model; {spec.name or 'this model'} is dense: drop "
                          f"--ep (or give --ep 1)")
    if spec.is_moe and spec.experts % ep:
        raise ConfigError(f"--ep {ep} must divide the model's {spec.experts} routed experts (each expert-parallel "
                          f"rank holds experts / ep); use one of {', '.join(map(str, _divisors(spec.experts)))}")
