"""One plan's predicted step: per-layer times from the analytic costs (`layer_times`), stages, the
1F1B schedule, the data-parallel sync, the optimizer, and the memory of the busiest GPU. The
records (`Plan`, `Workload`, `Estimate`) live in `plans` and are importable from here too.

Ranks are laid out as Megatron-LM does: tensor parallel innermost (consecutive GPUs, inside a
node), then data parallel, then pipeline stages outermost. A group whose members stay inside one
node uses the intra-node link, else the inter-node one. A ZeRO group is `dp / zero_ngroups`
consecutive data-parallel ranks (nnscaler.runtime.zero_groups), so it spans `tp * dp / zero_ngroups`
ranks.

Mixture of experts (`Plan.ep`, as Megatron-LM and torchtitan carve expert parallelism out of data
parallelism): `ep` consecutive data-parallel ranks split each MoE layer's routed experts (E / ep
each, the expert matrices also split over tp: expert tensor parallelism = tp), so an ep group spans
`tp * ep` ranks; the experts' gradients are reduced over the other dp / ep ranks (with ZeRO, their
shards spread over those). With context parallelism the ep ranks are carved out of the cp ranks
instead (ep is cp or 1, as the runtime's ``cp`` policy splits the experts over its unit or not,
``pas_config['ep_size']``; the cost model prices any ep dividing cp): an ep group still spans `tp * ep` consecutive ranks and the experts'
gradients are reduced over the dp·cp / ep ranks holding the same experts. Tokens reach their experts
by an all-to-all (dispatch) and return by another (combine), forward and backward; the busiest rank's
expert compute is `Workload.moe_imbalance` times the mean.

Context parallelism (`Plan.cp`, `context`): cp ranks follow tp (tp, cp, dp, pp), each holding s/cp
tokens of every sequence (activations, matmuls, elementwise ops and messages / cp; its 1/cp share of
the causal attention; the ring's exposed transfers in `Estimate.cp_comm_s`); the cp ranks hold
replicas of the weights, so the gradients are reduced (and ZeRO shards spread) over dp·cp ranks.
"""
from __future__ import annotations

import dataclasses
import math
from typing import List

from nnscaler.ir import ConfigError

from . import context, costs
from .cluster import Cluster
from .layer_times import all_to_all_time, group_link, head_times, layer_times
from .model import ModelSpec
from .plans import MOE_IMBALANCE, ZERO_STAGES, Estimate, Plan, Workload, zero_label

_layer_times = layer_times  # its earlier name here (tests/policies/test_estimate_context.py)

__all__ = ["MOE_IMBALANCE", "Plan", "Estimate", "Workload", "ZERO_STAGES", "estimate_plan", "gpu_layer_ids",
           "gpu_layers", "stage_layers", "zero_label", "zero_sync_times"]


def stage_layers(layers: int, pp: int) -> List[int]:
    """Layers per stage: ceil(layers / pp) each, the shortfall taken off the last and first stages
    in turn (they also hold the output head and the embedding), then the others from the end."""
    base = math.ceil(layers / pp)
    out = [base] * pp
    deficit = base * pp - layers
    order = [pp - 1, 0] + list(range(pp - 2, 0, -1)) if pp > 1 else [0]
    i = 0
    while deficit > 0:
        s = order[i % len(order)]
        if out[s] > 1:
            out[s] -= 1
            deficit -= 1
        i += 1
    return out


def gpu_layers(layers: int, pp: int, virtual: int = 1) -> List[int]:
    """Layers on each pipeline GPU: `stage_layers` over pp · virtual stages, GPU i holding stages
    i, i + pp, i + 2pp, ..."""
    chunks = stage_layers(layers, pp * virtual)
    return [sum(chunks[i::pp]) for i in range(pp)]


def gpu_layer_ids(layers: int, pp: int, virtual: int = 1) -> List[List[int]]:
    """The layer indices on each pipeline GPU (as `gpu_layers` counts them)."""
    chunks = stage_layers(layers, pp * virtual)
    starts = [sum(chunks[:j]) for j in range(len(chunks))]
    return [[i for j in range(g, len(chunks), pp) for i in range(starts[j], starts[j] + chunks[j])]
            for g in range(pp)]


def estimate_plan(spec: ModelSpec, cluster: Cluster, work: Workload, plan: Plan) -> Estimate:
    tp, pp, dp, b, v, ep, cp = plan.tp, plan.pp, plan.dp, plan.micro_batch, plan.virtual, plan.ep, plan.cp
    context.check_cp(work.seq, cp, "Plan.cp")
    if ep > 1 and (not spec.is_moe or spec.experts % ep):
        raise ConfigError(f"Plan.ep ({ep}) must divide the model's routed experts ({spec.experts}): each expert-"
                          f"parallel rank holds experts / ep of them" + ("" if spec.is_moe else "; a dense model "
                          "has none, use ep 1"))
    seq, nbytes = work.seq, cluster.gpu.dtype_bytes
    nmicros = work.sequences // (dp * b)
    overhead = costs.OPS_PER_LAYER * cluster.op_overhead_us * 1e-6
    fwd, bwd, tp_comm, (ring_f, ring_b) = layer_times(spec, b, seq, tp, cluster, cp=cp)
    fwd, bwd = fwd + overhead, bwd + 2 * overhead
    if plan.recompute:
        bwd += fwd
    layer_comm = tp_comm * (3 if plan.recompute else 2)  # forward, backward, and the recomputed forward
    ring = ring_f * (2 if plan.recompute else 1) + ring_b  # a layer's exposed ring (the same in MoE layers)
    # an MoE layer: the same with its MLP, and the dispatch and combine all-to-alls in every pass
    fwd_m = bwd_m = layer_comm_m = a2a = 0.0
    if spec.is_moe:
        fwd_m, bwd_m, tp_comm_m, _ = layer_times(spec, b, seq, tp, cluster, moe=(ep, work.moe_imbalance), cp=cp)
        fwd_m, bwd_m = fwd_m + overhead, bwd_m + 2 * overhead
        if plan.recompute:
            bwd_m += fwd_m
        layer_comm_m = tp_comm_m * (3 if plan.recompute else 2)
        a2a = all_to_all_time(spec, b, seq, tp, ep, cluster, cp) * (3 if plan.recompute else 2)
    head_f, head_b = head_times(spec, b, seq, tp, cluster, cp)
    tokens = b * seq / cp  # a rank's tokens of a micro-batch
    emb = costs.memory_bound_time(3 * tokens * spec.hidden / tp * nbytes, cluster)  # lookup + its gradient
    ids = gpu_layer_ids(spec.layers, pp, v)
    moe_ids = set(spec.moe_layer_ids)
    counts = [len(x) for x in ids]
    nm = [sum(1 for i in x if i in moe_ids) for x in ids]  # MoE layers on each GPU
    nd = [c - n for c, n in zip(counts, nm)]  # dense layers
    # pipeline messages: the boundary activation (sequence-parallel: 1/tp of it) forward and its gradient
    # back, once per stage a GPU holds
    pp_link = group_link(cluster, tp * cp * dp + 1)  # neighbouring stages are tp·cp·dp ranks apart
    p2p = 2 * v * costs.p2p_time(tokens * spec.hidden / tp * nbytes, pp_link) if pp > 1 else 0.0

    def gpu_time(i):
        c = nd[i] * (fwd + bwd) + nm[i] * (fwd_m + bwd_m)
        if i == 0:
            c += emb
        if i == pp - 1:
            c += head_f + head_b
        return c, nd[i] * layer_comm + nm[i] * layer_comm_m, nm[i] * a2a, counts[i] * ring

    times = [gpu_time(i) for i in sorted({0, pp - 1, min(1, pp - 1)})]
    comp, comm, ep_comm, cp_comm = max(times, key=sum)
    per_micro = comp + comm + ep_comm + cp_comm + p2p
    compute_s, tp_comm_s, pp_comm_s, ep_comm_s = nmicros * comp, nmicros * comm, nmicros * p2p, nmicros * ep_comm
    cp_comm_s = nmicros * cp_comm
    bubble_s = (pp - 1) * per_micro / v

    # parameters per GPU of the first and last pipeline GPUs (biases, position embeddings: in proportion);
    # the routed experts apart (split over tp·ep, their gradients reduced over dp / ep)
    layer_p, emb_p = spec.dense_layer_params / tp, spec.embedding_params / tp
    moe_p, routed_p = spec.moe_layer_params / tp, spec.routed_layer_params / (tp * ep)
    scale = spec.total_params / max(1.0, spec.layers_params + spec.embedding_params * (1 if spec.tied else 2))
    first_p = (nd[0] * layer_p + nm[0] * moe_p + emb_p + (emb_p if pp == 1 and not spec.tied else 0.0)) * scale
    last_p = (nd[-1] * layer_p + nm[-1] * moe_p + emb_p) * scale if pp > 1 else first_p
    first_e, last_e = nm[0] * routed_p * scale, nm[-1] * routed_p * scale
    local_p, local_e = max((first_p, first_e), (last_p, last_e), key=sum)

    # data-parallel gradient sync (over dp·cp: the cp ranks hold replicas), overlapped with one micro-batch's
    # backward; ZeRO's all-gathers exposed
    grads = local_p * nbytes
    sync_plan = dataclasses.replace(plan, dp=dp * cp, cp=1)
    reduce, gather = zero_sync_times(grads, sync_plan, nmicros, cluster)
    experts_plan = dataclasses.replace(plan, dp=dp * cp // ep, ep=1, cp=1, zero_ngroups=1)  # expert-data-parallel
    if local_e:
        r_e, g_e = zero_sync_times(local_e * nbytes, experts_plan, nmicros, cluster, stride=ep)
        reduce, gather = reduce + r_e, gather + g_e
    dp_comm_s = max(0.0, reduce - (nd[0] * bwd + nm[0] * bwd_m) / v) + gather
    # Adam reads and writes its state (and fp32 master weights), reads the gradient, writes the weights
    opt_state = costs.optimizer_bytes_per_param(cluster.gpu.dtype)
    shard, e_shard = sync_plan.zero_group, experts_plan.zero_group
    per_param = 2 * opt_state + (2 if cluster.gpu.dtype == "bf16" else 3) * nbytes
    opt_bytes = local_p * per_param
    optimizer_s = costs.memory_bound_time(opt_bytes / shard + local_e * per_param / e_shard, cluster) \
        + 2 * overhead / costs.OPS_PER_LAYER
    step_s = compute_s + tp_comm_s + pp_comm_s + bubble_s + dp_comm_s + optimizer_s + ep_comm_s + cp_comm_s

    # memory: the first GPU keeps min(pp, nmicros) micro-batches of activations (1F1B), more interleaved
    # (without fused attention also the scores: softmax output, dropout mask and output, Korthikanti et al.)
    scores = 0.0 if cluster.fused_attention else (2 * nbytes + 1) * spec.heads / tp * tokens * seq
    per_layer_act = tokens * spec.act_elements_per_token() / tp * nbytes + scores
    moe_act = tokens * spec.moe_act_elements_per_token(work.moe_imbalance) / tp * nbytes + scores \
        if spec.is_moe else 0.0
    layer_input = tokens * spec.hidden / tp * nbytes
    working = (max(per_layer_act if any(nd) else 0.0, moe_act) if spec.is_moe else per_layer_act) \
        if plan.recompute else 0.0  # the layer being recomputed
    widest = spec.ffn if not spec.is_moe else max(spec.ffn if spec.moe_layers < spec.layers else 0,
                                                   spec.top_k * spec.expert_ffn * work.moe_imbalance, spec.shared_ffn)
    transient = 2 * tokens * (2 if spec.gated else 1) * widest / tp * nbytes
    if cp > 1:  # the ring's blocks in flight: K/V held and arriving, with their dK/dV in backward
        transient += 4 * context.kv_block_bytes(spec, b, seq, tp, cp, nbytes)
    logits = tokens * spec.vocab / tp * 4 * 2  # fp32 logits and their gradient, on the last GPU

    # ZeRO-3 shards the weights and gradients too; without a pipeline the Trainer accumulates micro-batches
    # under no_sync, which keeps the units' full gradients until the last one reduce-scatters them; a
    # pipeline reduce-scatters every micro-batch's (shard-size gradients only; nnscaler.runtime.zero3)
    weight_shard = shard if plan.zero == 3 else 1
    weight_shard_e = e_shard if plan.zero == 3 else 1
    full_grads = 1.0 if plan.zero == 3 and nmicros > 1 and plan.pp == 1 else 0.0
    # ZeRO-3's gathered units: the root (embeddings, head) for the whole pass, two decoder layers, with gradients
    root_p = emb_p * (1 if spec.tied else 2) * scale
    unit_p = max(layer_p, moe_p + routed_p) if spec.is_moe else layer_p
    gathered = 2 * (root_p + 2 * unit_p * scale) * nbytes if plan.zero == 3 else 0.0

    def parts(params, experts, i, inflight, with_logits):
        kept = (layer_input * counts[i] if plan.recompute else nd[i] * per_layer_act + nm[i] * moe_act) * inflight
        return {"weights": params * nbytes / weight_shard + experts * nbytes / weight_shard_e,
                "gradients": params * nbytes * (1 / weight_shard + full_grads)
                + experts * nbytes * (1 / weight_shard_e + full_grads),
                "optimizer": params * opt_state / shard + experts * opt_state / e_shard,
                "activations": kept + working,
                "transient": transient + (logits if with_logits else 0.0), "gathered": gathered}

    first = parts(first_p, first_e, 0, min(pp, nmicros) * costs.interleaved_activation_factor(pp, v), pp == 1)
    last = parts(last_p, last_e, -1, 1, True) if pp > 1 else first
    mem_parts = max(first, last, key=lambda d: sum(d.values()))
    memory = sum(mem_parts.values())
    flops = costs.model_flops(spec.active_params, work.global_batch_tokens, spec.layers, spec.heads, spec.attn_dim,
                              seq)
    return Estimate(plan, nmicros, step_s, compute_s, bubble_s, tp_comm_s, pp_comm_s, dp_comm_s, optimizer_s,
                    memory, mem_parts, memory <= cluster.gpu.memory_gb * costs.GiB * costs.USABLE_MEMORY, flops,
                    work.global_batch_tokens / step_s, flops / step_s / work.gpus / 1e12,
                    costs.mfu(flops, step_s, work.gpus, cluster.gpu.peak_flops), ep_comm_s, cp_comm_s)


def zero_sync_times(grads: float, plan: Plan, nmicros: int, cluster: Cluster, stride: int = 1):
    """(gradient reduction s, exposed gathers s) of one step's data-parallel traffic for `grads` bytes
    of local gradients (= local parameters). The reduction may overlap a backward. Exposed gathers:
    ZeRO-1's after the step; ZeRO-3's: one pass of the parameters per micro-batch (the runtime
    prefetches the next block in forward and in backward, so all but about one block's gather per
    pass overlap compute; counted as one pass of the two exposed, a conservative middle).

    * no ZeRO: a ring all-reduce over dp.
    * ZeRO-1: a reduce-scatter in the zero group, then an all-gather of the updated parameters after
      the step.
    * ZeRO-3: each micro-batch all-gathers the parameters twice (forward, and again in backward: they
      were freed), and the step reduce-scatters the gradients once (the Trainer's last micro-batch;
      with a pipeline every micro-batch's backward reduce-scatters, `nmicros` times a step).

    With ZeRO and ``zero_ngroups > 1`` the shard's gradient is also all-reduced across the groups.
    The zero group spans tp·dp/zero_ngroups ranks, the cross-group reduction tp·dp: each on the link
    its span needs (intra-node inside a node, else inter-node). `stride`: the group's ranks are that
    many dp ranks apart (the experts' dp / ep ranks, `stride = ep`), widening the spans as much."""
    tp, dp, z, g = plan.tp, plan.dp, plan.zero_group, plan.zero_ngroups
    dp_link = group_link(cluster, tp * dp * stride)
    if not plan.zero:
        return costs.ring_all_reduce_time(grads, dp, dp_link), 0.0
    zero_link = group_link(cluster, tp * z * stride)
    reduce = costs.ring_all_gather_time(grads, z, zero_link)  # a reduce-scatter moves what an all-gather does
    reduce += costs.ring_all_reduce_time(grads / z, g, dp_link)
    if plan.zero == 3 and plan.pp > 1:
        reduce *= nmicros
    gathers = 1 if plan.zero == 1 else nmicros  # ZeRO-3: see the docstring
    return reduce, gathers * costs.ring_all_gather_time(grads, z, zero_link)
