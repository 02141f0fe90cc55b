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

``ep_size`` (this policy and ``cp``): the devices of a unit (or stage) each expert layer is split
over: all of them (the default); 1 (every expert on every device, the op split along its tokens,
as ``tp`` splits it); or k in between: each device still stores 1/n of the experts (weights,
gradients, optimizer state), but the tokens are exchanged only inside groups of k consecutive
devices; the device at group position p computes E/k experts, which it all-gathers at forward from
the n/k devices at position p of every group (backward: a reduce-scatter of their gradients), and
holds from the layer's forward to its backward (``nnscaler.runtime.expert_groups``).

Tensor parallelism where asked: ``tp_modules`` (module path globs, e.g. ``["*.self_attn"]``) makes
the ops inside those modules follow Megatron's rule over the same devices (column / row-parallel
projections by the ``column`` / ``row`` / ``heads`` globs of ``megatron``, defaults included);
the layouts between them and the token-split ops are converted by the usual adapters.
"""
from __future__ import annotations

from typing import Optional, Sequence

from nnscaler.ir import EXPERT_DIM, ROUTED_EXPERTS, ConfigError, Shard, expert_group_dim

from ..plan import Piece, PlanError, tensor_inputs, tensor_outputs
from ..registry import register_policy
from ._spread import split_activation_batch_or_replicate, split_batch_or_replicate
from ._unit_plan import UNIT_KEYS, TensorParallelModules, devices_of, stage_if_asked

__all__ = ["ep", "split_experts", "moe_blocks", "ep_size_of", "split_routed_experts"]

_EXPERT_HINTS = ("expert", "moe")


@register_policy("ep", keys=UNIT_KEYS | {"ep_size"}, pipelines=True)
def ep(graph, cfg):
    experts = [n for n in graph.nodes if n.target == ROUTED_EXPERTS]
    if not experts:
        raise PlanError(_no_experts(graph))
    pp_size = stage_if_asked(graph, cfg, "ep")
    ep_size = ep_size_of(dict(cfg.pas_config or {}), cfg.plan_ngpus // pp_size, "ep")
    tp = TensorParallelModules(dict(cfg.pas_config or {}))
    for node in graph.nodes:
        devices = devices_of(graph, node, cfg.plan_ngpus)
        tp_dim = tp.dim(graph, node, devices)
        if node.target == ROUTED_EXPERTS and len(devices) > 1:
            split_routed_experts(graph, node, devices, ep_size)
        elif tp_dim is not None:
            tp.split(graph, node, tp_dim, devices)
        else:
            split_activation_batch_or_replicate(graph, node, devices)
    return graph


def ep_size_of(pas: dict, devices: int, policy: str) -> Optional[int]:
    """``pas_config['ep_size']`` checked against the `devices` of a unit (or stage); None: all of them."""
    if "ep_size" not in pas:
        return None
    k = pas["ep_size"]
    if isinstance(k, bool) or not isinstance(k, int) or k < 1 or devices % k:
        raise ConfigError(f"pas_config['ep_size'] must be a whole number dividing the {devices} devices each expert "
                          f"layer runs on under pas_policy {policy!r} (plan_ngpus / pp_size), got {k!r}")
    return k


def split_routed_experts(graph, node, devices: Sequence[int], ep_size: Optional[int]) -> None:
    """A routed-experts op over `devices`: its experts split over them (`split_experts`); with ``ep_size``
    1 every expert on every device and the op split along its tokens; with ``ep_size`` k in between the
    experts stored split over all the devices, their tokens exchanged inside groups of k."""
    if ep_size == 1:
        split_batch_or_replicate(graph, node, devices)
    else:
        split_experts(graph, node, devices, None if ep_size == len(devices) else ep_size)


def split_experts(graph, node, devices: Sequence[int], group: Optional[int] = None) -> None:
    """Piece i of routed-experts op `node` on ``devices[i]``: 1/n of its tokens and of its experts. With
    `group` k (1 < k < n) the storage is the same, but the piece's dim is `expert_group_dim(k)` (codegen
    passes ``ep_size=k``): the tokens are exchanged inside groups of k consecutive devices, each device
    gathering the experts of its group position from the devices at that position in every group."""
    n = len(devices)
    ins = tensor_inputs(graph, node)
    tokens, k = graph.value(ins[1]).shape
    num_experts = graph.value(ins[3]).shape[0]
    where = f"the mixture-of-experts layer {node.module_path or node.describe()}"
    if k > num_experts:
        raise PlanError(f"{where} routes each token to top-k = {k} experts but has only {num_experts}: "
                        f"num_experts_per_tok must be at most the number of experts")
    if num_experts % n and group:
        raise PlanError(f"{where} has {num_experts} experts, which do not split over the {n} devices that store "
                        f"them under pas_config['ep_size'] ({group}): each device stores 1/{n} of the experts, the "
                        f"groups of {group} only exchange the tokens; use plan_ngpus / pp_size dividing {num_experts}, "
                        f"or ep_size=1: every expert on every device")
    if num_experts % n:
        raise PlanError(f"{where} has {num_experts} experts, which do not split over the expert-parallel size {n} "
                        f"(plan_ngpus / pp_size): use an ep size that divides {num_experts} (e.g. plan_ngpus="
                        f"{_divisor(num_experts, n)}, or ep_size=1: every expert on every device), or a model whose "
                        f"expert count it divides")
    if tokens % n:
        raise PlanError(f"{where} receives {tokens} tokens when traced (batch x sequence), which do not split "
                        f"into {n} equal parts: make the micro-batch size times the sequence length a multiple of {n}")
    outs = [Shard(0)] * len(tensor_outputs(graph, node))
    dim = expert_group_dim(group) if group else EXPERT_DIM
    node.pieces = [Piece(i, n, [Shard(0)] * len(ins), list(outs), dim, device) for i, device in enumerate(devices)]


def moe_blocks(graph) -> set:
    """The module paths of the mixture-of-experts blocks: the module holding each routed-experts op
    (transformers' sparse block, whose ``experts`` module traced to the op), or the op's own module
    when that module computes more than the op (a user's MoE module calling ``routed_experts``)."""
    paths = {n.module_path or "" for n in graph.nodes if n.target == ROUTED_EXPERTS}
    alone = {p for p in paths if all(n.target == ROUTED_EXPERTS for n in graph.nodes if (n.module_path or "") == p)}
    return {p.rsplit(".", 1)[0] if p in alone and "." in p else p for p in paths}


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
