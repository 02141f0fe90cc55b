"""`ep`: expert parallelism for mixture-of-experts models, data parallelism inside the plan.

Each routed-experts op (``nnscaler.ir.ops.moe.routed_experts``: what transformers' experts
modules trace to) is split over the plan's devices along its experts dim: device i holds experts
``[i * E/n, (i + 1) * E/n)`` and 1/n of the tokens, and the tokens travel to their experts' devices
by all-to-all (``nnscaler.runtime.moe``). Every other op is split along the leading dim of its
first activation input (the batch, or the tokens; a norm's ``weight * x`` along x's batch, not the
weight's width), or replicated where that does not split: the plan computes the
whole batch, so the router's statistics and auxiliary loss are those of one process on the whole
batch. Data parallelism across units (``runtime_ngpus > plan_ngpus``) and ZeRO compose as usual.

Pipeline keys (as ``hybrid``, needs ``use_end2end=True``): ``pp_size`` > 1 cuts the model into
``pipeline_nstages`` (default ``pp_size``) stages, each on ``plan_ngpus // pp_size`` devices over which
its experts are split; ``pipeline_nmicros``, ``pipeline_scheduler``, ``pipeline_pivots`` as there.

Tensor parallelism where asked: ``tp_modules`` (module path globs, e.g. ``["*.self_attn"]``) makes
the ops inside those modules follow Megatron's rule over the same devices (column / row-parallel
projections by the ``column`` / ``row`` / ``heads`` globs of ``megatron``, defaults included);
the layouts between them and the token-split ops are converted by the usual adapters.
"""
from __future__ import annotations

import fnmatch
from typing import Sequence

from nnscaler.ir import EXPERT_DIM, ROUTED_EXPERTS, ConfigError, Shard

from ..plan import Piece, PlanError, tensor_inputs, tensor_outputs
from ..pipeline import pivot_leads
from ..registry import register_policy
from ._spread import split_activation_batch_or_replicate, split_over_unit
from .megatron import megatron_dim, megatron_globs, note_split
from .hybrid import COMMON_KEYS as PIPELINE_KEYS, _int, _pipeline, _scheduler

__all__ = ["ep", "split_experts"]

_EXPERT_HINTS = ("expert", "moe")


@register_policy("ep", keys=PIPELINE_KEYS | {"tp_modules", "column", "row", "heads"}, pipelines=True)
def ep(graph, cfg):
    pas = dict(cfg.pas_config or {})
    ngpus = cfg.plan_ngpus
    pp_size = _int("pp_size", pas.get("pp_size", 1))
    experts = [n for n in graph.nodes if n.target == ROUTED_EXPERTS]
    if not experts:
        raise PlanError(_no_experts(graph))
    if ngpus % pp_size:
        raise ConfigError(f"pas_policy 'ep': plan_ngpus ({ngpus}) must be a multiple of pp_size ({pp_size})")
    if pp_size > 1:
        if not cfg.use_end2end:
            raise ConfigError("pas_policy 'ep' with pp_size > 1 pipelines the whole model and needs "
                              "ComputeConfig(use_end2end=True) (train_step runs the micro-batches)")
        if "pipeline_nmicros" not in pas:
            raise ConfigError("pas_policy 'ep' with pp_size > 1 needs pas_config['pipeline_nmicros'] (micro-batches "
                              "per step)")
        nmicros, scheduler = _int("pipeline_nmicros", pas["pipeline_nmicros"]), _scheduler("ep", cfg, pas)
        nstages = _int("pipeline_nstages", pas.get("pipeline_nstages", pp_size))
        pivots = pas.get("pipeline_pivots")
        _pipeline(graph, cfg, nstages, pp_size, nmicros, scheduler, pivot_leads(graph, pivots) if pivots else None)
    tp_modules = _globs("tp_modules", pas.get("tp_modules", ()))
    globs, split_on = megatron_globs(pas), {}
    for node in graph.nodes:
        devices = graph.pipeline.home_devices(node.stage) if graph.pipeline is not None else tuple(range(ngpus))
        tp_dim = megatron_dim(graph, node, len(devices), globs, split_on) \
            if len(devices) > 1 and _inside(node.module_path, tp_modules) else None
        if node.target == ROUTED_EXPERTS and len(devices) > 1:
            split_experts(graph, node, devices)
        elif tp_dim is not None:
            split_over_unit(graph, node, tp_dim, len(devices), devices)
            note_split(graph, node, split_on)
        else:
            split_activation_batch_or_replicate(graph, node, devices)
    return graph


def _globs(key: str, value) -> tuple:
    value = [value] if isinstance(value, str) else value
    if not isinstance(value, (list, tuple)) or not all(isinstance(g, str) and g for g in value):
        raise ConfigError(f"pas_config[{key!r}] must be a module path glob or a list of them (e.g. "
                          f"['*.self_attn']), got {value!r}")
    return tuple(value)


def _inside(path: str, globs) -> bool:
    return any(fnmatch.fnmatchcase(path, g) or fnmatch.fnmatchcase(path, g + ".*") for g in globs)


def split_experts(graph, node, devices: Sequence[int]) -> None:
    """Piece i of routed-experts op `node` on ``devices[i]``: 1/n of its tokens and of its experts."""
    n = len(devices)
    ins = tensor_inputs(graph, node)
    tokens, k = graph.value(ins[1]).shape
    num_experts = graph.value(ins[3]).shape[0]
    where = f"the mixture-of-experts layer {node.module_path or node.describe()}"
    if k > num_experts:
        raise PlanError(f"{where} routes each token to top-k = {k} experts but has only {num_experts}: "
                        f"num_experts_per_tok must be at most the number of experts")
    if num_experts % n:
        raise PlanError(f"{where} has {num_experts} experts, which do not split over the expert-parallel size "
                        f"{n} (plan_ngpus / pp_size): use an ep size that divides {num_experts} "
                        f"(e.g. plan_ngpus={_divisor(num_experts, n)}), or a model whose expert count it divides")
    if tokens % n:
        raise PlanError(f"{where} receives {tokens} tokens when traced (batch x sequence), which do not split "
                        f"into {n} equal parts: make the micro-batch size times the sequence length a multiple of {n}")
    outs = [Shard(0)] * len(tensor_outputs(graph, node))
    node.pieces = [Piece(i, n, [Shard(0)] * len(ins), list(outs), EXPERT_DIM, device)
                   for i, device in enumerate(devices)]


def _divisor(total: int, n: int) -> int:
    return max(d for d in range(1, n + 1) if total % d == 0)


def _no_experts(graph) -> str:
    found = sorted({path for path, cls in graph.module_types.items()
                    if any(h in cls.rsplit(".", 1)[-1].lower() for h in _EXPERT_HINTS)})
    by_params = set()
    for name in graph.params:
        parts = name.split(".")
        if "experts" in parts[:-1]:
            by_params.add(".".join(parts[:parts.index("experts") + 1]))
    found += sorted(by_params - set(found))
    seen = (f"; modules that look like experts but were traced op by op: {', '.join(found[:6])}"
            + (" ..." if len(found) > 6 else "")) if found else ""
    return (f"pas_policy 'ep' found no routed-experts op in {graph.module_class}{seen}. nnscaler recognises "
            f"transformers' experts modules (classes marked use_experts_implementation: Mixtral, Qwen2/3-MoE, "
            f"DeepSeek-V3, gpt-oss, ...); for your own MoE module call nnscaler.routed_experts(hidden, top_k_index, "
            f"top_k_weights, gate_up, down, ...) in its forward (docs/moe.md \"Your own MoE module\"), or use "
            f"another policy for a model without experts")
