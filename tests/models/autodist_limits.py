"""A memory limit halfway between autodist's least-memory plan and the least-memory plan that keeps
every parameter whole, so that the plan must shard a parameter (computed the way the policy does: same trace,
same cost model)."""
from __future__ import annotations

import hf_models
import model_plans as mp


def tight_limit_gb(name: str, plan_ngpus: int, world: int) -> float:
    from nnscaler.ir import ComputeConfig, trace
    from nnscaler.policies.autodist.config import AutodistConfig
    from nnscaler.policies.autodist.comm_model import CommModel
    from nnscaler.policies.autodist.cost_model import build_problem
    from nnscaler.policies.autodist.policy import _transient
    per = mp.GLOBAL_BATCH // (world // plan_ngpus)
    graph = trace(hf_models.make(name), hf_models.batch(name, 0, per))
    cfg = AutodistConfig.from_compute_config(ComputeConfig(plan_ngpus, world))
    times = {n.id: (1e-4, 2e-4) for n in graph.nodes}
    problem = build_problem(graph, plan_ngpus, times, CommModel(), cfg)
    least = problem.const_mem + sum(min(op.mem) for op in problem.ops)
    # the least memory while every parameter stays whole: the limit lies below it
    whole = problem.const_mem + sum(min(m for m, p in zip(op.mem, op.param_mem) if p == max(op.param_mem))
                                    for op in problem.ops)
    transient = _transient(problem, [0] * len(problem.ops), cfg.transient_mem_coef)
    assert least < whole, f"{name}: no choice shards a parameter"
    return ((least + whole) / 2 + transient) / 1024 ** 3
