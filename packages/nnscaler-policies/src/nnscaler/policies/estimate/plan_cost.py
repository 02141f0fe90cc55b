"""One plan's predicted step: per-layer times from the analytic costs, stages, the 1F1B schedule,
the data-parallel sync, the optimizer, and the memory of the busiest GPU.

Ranks are laid out as Megatron-LM does: tensor parallel innermost (consecutive GPUs, inside a
node), then data parallel, then pipeline stages outermost. A group whose members stay inside one
node uses the intra-node link, else the inter-node one. A ZeRO group is `dp / zero_ngroups`
consecutive data-parallel ranks (nnscaler.runtime.zero_groups), so it spans `tp * dp / zero_ngroups`
ranks.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Dict, List

from nnscaler.ir import ConfigError

from . import costs
from .cluster import Cluster
from .model import ModelSpec

__all__ = ["Plan", "Estimate", "Workload", "ZERO_STAGES", "estimate_plan", "gpu_layers", "stage_layers", "zero_label",
           "zero_sync_times"]

ZERO_STAGES = (0, 1, 3)


@dataclasses.dataclass(frozen=True)
class Plan:
    tp: int
    pp: int
    dp: int
    # ZeRO stage (ComputeConfig.use_zero): 0 none; 1 optimizer state sharded over the zero group;
    # 3 parameters, gradients and optimizer state sharded (fully sharded; no pipeline: pp must be 1)
    zero: int
    micro_batch: int  # sequences per micro-batch per data-parallel rank
    recompute: bool  # every decoder layer recomputed in backward
    virtual: int = 1  # pipeline stages per GPU: 1 is 1F1B, more is interleaved 1F1B
    zero_ngroups: int = 1  # ComputeConfig.zero_ngroups: the dp ranks split into this many zero groups

    def __post_init__(self):
        if self.zero not in ZERO_STAGES:
            raise ConfigError(f"Plan.zero must be one of {ZERO_STAGES} (ComputeConfig.use_zero's stages), "
                              f"got {self.zero!r}")
        if self.zero_ngroups < 1 or self.dp % self.zero_ngroups or (self.zero_ngroups > 1 and not self.zero):
            raise ConfigError(f"Plan.zero_ngroups ({self.zero_ngroups}) must divide dp ({self.dp}), and needs "
                              f"zero 1 or 3 when above 1")

    @property
    def zero_group(self) -> int:
        """Ranks one ZeRO shard is spread over: dp / zero_ngroups with ZeRO, else 1."""
        return self.dp // self.zero_ngroups if self.zero else 1

    @property
    def family(self) -> str:
        return f"tp{self.tp} pp{self.pp} dp{self.dp}"

    def describe(self) -> str:
        return (f"{self.family}" + (f" v{self.virtual}" if self.virtual > 1 else "")
                + zero_label(self.zero, self.zero_ngroups)
                + f" mb{self.micro_batch}" + (" recompute" if self.recompute else ""))


def zero_label(zero: int, ngroups: int = 1) -> str:
    """' zero1', ' zero3', ' zero3/g2' (two zero groups) or '' without ZeRO: a plan name's part."""
    return (f" zero{zero}" + (f"/g{ngroups}" if ngroups > 1 else "")) if zero else ""


@dataclasses.dataclass(frozen=True)
class Workload:
    gpus: int
    seq: int
    global_batch_tokens: int

    @property
    def sequences(self) -> int:
        return self.global_batch_tokens // self.seq


@dataclasses.dataclass
class Estimate:
    plan: Plan
    nmicros: int
    step_s: float
    compute_s: float  # nmicros x the slowest stage's compute (recomputation included)
    bubble_s: float
    tp_comm_s: float
    pp_comm_s: float
    dp_comm_s: float  # exposed data-parallel sync (+ ZeRO-1's all-gather after the step, ZeRO-3's gathers)
    optimizer_s: float
    memory_bytes: float
    memory_parts: Dict[str, float]
    fits: bool
    model_flops: float
    tokens_per_s: float
    tflops_per_gpu: float
    mfu: float

    @property
    def comm_s(self) -> float:
        return self.tp_comm_s + self.pp_comm_s + self.dp_comm_s

    @property
    def memory_gb(self) -> float:
        return self.memory_bytes / costs.GiB


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


def _group_link(cluster: Cluster, span: int):
    """The link a group uses whose members lie within `span` consecutive ranks."""
    return cluster.intra_node if span <= cluster.gpus_per_node else cluster.inter_node


def _layer_times(spec: ModelSpec, b: int, seq: int, tp: int, cluster: Cluster):
    """(forward s, backward s, tp comm s per forward pass) of one decoder layer on one micro-batch."""
    m = b * seq
    h, hd = spec.hidden, spec.head_dim
    mats = [(m, h, (spec.heads + 2 * spec.kv_heads) * hd / tp),  # q, k, v
            (m, spec.heads * hd / tp, h),  # attention output projection
            (m, h, (2 if spec.gated else 1) * spec.ffn / tp),  # up (and gate)
            (m, spec.ffn / tp, h)]  # down
    mm = sum(costs.matmul_time(*shape, cluster) for shape in mats)
    att = costs.attention_time(b, seq, spec.heads / tp, hd, cluster)
    # norms, residual adds, rotary on q and k, the MLP activation: elements read + written per token
    elementwise = 10 * h + 2 * (spec.heads + spec.kv_heads) * hd + (3 if spec.gated else 2) * spec.ffn
    ew = costs.memory_bound_time(m * elementwise / tp * cluster.gpu.dtype_bytes, cluster)
    fwd = mm + att + ew
    bwd = 2 * mm + costs.ATTENTION_BACKWARD * att + 2 * ew
    # Megatron TP (sequence parallel): 2 all-gathers + 2 reduce-scatters of b·s·h a pass (= 2 all-reduces)
    comm = 2 * costs.ring_all_reduce_time(m * h * cluster.gpu.dtype_bytes, tp, cluster.intra_node)
    return fwd, bwd, comm


def _head_times(spec: ModelSpec, b: int, seq: int, tp: int, cluster: Cluster):
    """(forward s, backward s) of the output projection and the loss over fp32 logits (vocab split over tp)."""
    m = b * seq
    mm = costs.matmul_time(m, spec.hidden, spec.vocab / tp, cluster)
    loss = costs.memory_bound_time(m * spec.vocab / tp * 4 * 4, cluster)  # cast, softmax, grad: ~4 fp32 passes
    return mm + loss / 2, 2 * mm + loss / 2


def gpu_layers(layers: int, pp: int, virtual: int = 1) -> List[int]:
    """Layers on each pipeline GPU: `stage_layers` over pp · virtual stages, GPU i holding stages
    i, i + pp, i + 2pp, ..."""
    chunks = stage_layers(layers, pp * virtual)
    return [sum(chunks[i::pp]) for i in range(pp)]


def estimate_plan(spec: ModelSpec, cluster: Cluster, work: Workload, plan: Plan) -> Estimate:
    tp, pp, dp, b, v = plan.tp, plan.pp, plan.dp, plan.micro_batch, plan.virtual
    seq, nbytes = work.seq, cluster.gpu.dtype_bytes
    nmicros = work.sequences // (dp * b)
    overhead = costs.OPS_PER_LAYER * cluster.op_overhead_us * 1e-6
    fwd, bwd, tp_comm = _layer_times(spec, b, seq, tp, cluster)
    fwd, bwd = fwd + overhead, bwd + 2 * overhead
    if plan.recompute:
        bwd += fwd
    layer_comm = tp_comm * (3 if plan.recompute else 2)  # forward, backward, and the recomputed forward
    head_f, head_b = _head_times(spec, b, seq, tp, cluster)
    emb = costs.memory_bound_time(3 * b * seq * spec.hidden / tp * nbytes, cluster)  # lookup + its gradient
    counts = gpu_layers(spec.layers, pp, v)
    # pipeline messages: the boundary activation (sequence-parallel: 1/tp of it) forward and its gradient
    # back, once per stage a GPU holds
    pp_link = _group_link(cluster, tp * dp + 1)  # neighbouring stages are tp·dp ranks apart
    p2p = 2 * v * costs.p2p_time(b * seq * spec.hidden / tp * nbytes, pp_link) if pp > 1 else 0.0

    def gpu_time(i):
        c = counts[i] * (fwd + bwd)
        if i == 0:
            c += emb
        if i == pp - 1:
            c += head_f + head_b
        return c, counts[i] * layer_comm

    times = [gpu_time(i) for i in sorted({0, pp - 1, min(1, pp - 1)})]
    comp, comm = max(times, key=sum)
    per_micro = comp + comm + p2p
    compute_s, tp_comm_s, pp_comm_s = nmicros * comp, nmicros * comm, nmicros * p2p
    bubble_s = (pp - 1) * per_micro / v

    # parameters per GPU of the first and last pipeline GPUs (biases, position embeddings: in proportion)
    layer_p, emb_p = spec.layer_params / tp, spec.embedding_params / tp
    scale = spec.total_params / max(1.0, spec.layers * spec.layer_params
                                    + spec.embedding_params * (1 if spec.tied else 2))
    first_p = (counts[0] * layer_p + emb_p + (emb_p if pp == 1 and not spec.tied else 0.0)) * scale
    last_p = (counts[-1] * layer_p + emb_p) * scale if pp > 1 else first_p
    local_p = max(first_p, last_p)

    # data-parallel gradient sync, overlapped with one micro-batch's backward; ZeRO's all-gathers exposed
    grads = local_p * nbytes
    reduce, gather = zero_sync_times(grads, plan, nmicros, cluster)
    dp_comm_s = max(0.0, reduce - counts[0] * bwd / v) + gather
    # Adam reads and writes its state (and fp32 master weights), reads the gradient, writes the weights
    opt_state = costs.optimizer_bytes_per_param(cluster.gpu.dtype)
    shard = plan.zero_group
    opt_bytes = local_p * (2 * opt_state + (2 if cluster.gpu.dtype == "bf16" else 3) * nbytes)
    optimizer_s = costs.memory_bound_time(opt_bytes / shard, cluster) + 2 * overhead / costs.OPS_PER_LAYER
    step_s = compute_s + tp_comm_s + pp_comm_s + bubble_s + dp_comm_s + optimizer_s

    # memory: the first GPU keeps min(pp, nmicros) micro-batches of activations (1F1B), more interleaved
    per_layer_act = b * seq * spec.act_elements_per_token() / tp * nbytes
    layer_input = b * seq * spec.hidden / tp * nbytes
    working = per_layer_act if plan.recompute else 0.0  # the layer being recomputed
    transient = 2 * b * seq * (2 if spec.gated else 1) * spec.ffn / tp * nbytes
    logits = b * seq * spec.vocab / tp * 4 * 2  # fp32 logits and their gradient, on the last GPU

    # ZeRO-3 shards the weights and gradients too; without a pipeline the Trainer accumulates micro-batches
    # under no_sync, which keeps the units' full gradients until the last one reduce-scatters them; a
    # pipeline reduce-scatters every micro-batch's (shard-size gradients only; nnscaler.runtime.zero3)
    weight_shard = shard if plan.zero == 3 else 1
    full_grads = 1.0 if plan.zero == 3 and nmicros > 1 and plan.pp == 1 else 0.0
    # ZeRO-3's gathered units: the root (embeddings, head) for the whole pass, two decoder layers, with gradients
    root_p = emb_p * (1 if spec.tied else 2) * scale
    gathered = 2 * (root_p + 2 * layer_p * scale) * nbytes if plan.zero == 3 else 0.0

    def parts(params, layers, inflight, with_logits):
        kept = (layer_input if plan.recompute else per_layer_act) * layers * inflight
        return {"weights": params * nbytes / weight_shard,
                "gradients": params * nbytes * (1 / weight_shard + full_grads),
                "optimizer": params * opt_state / shard, "activations": kept + working,
                "transient": transient + (logits if with_logits else 0.0), "gathered": gathered}

    first = parts(first_p, counts[0], min(pp, nmicros) * costs.interleaved_activation_factor(pp, v), pp == 1)
    last = parts(last_p, counts[-1], 1, True) if pp > 1 else first
    mem_parts = max(first, last, key=lambda d: sum(d.values()))
    memory = sum(mem_parts.values())
    flops = costs.model_flops(spec.total_params, work.global_batch_tokens, spec.layers, spec.heads, spec.head_dim, seq)
    return Estimate(plan, nmicros, step_s, compute_s, bubble_s, tp_comm_s, pp_comm_s, dp_comm_s, optimizer_s,
                    memory, mem_parts, memory <= cluster.gpu.memory_gb * costs.GiB * costs.USABLE_MEMORY, flops,
                    work.global_batch_tokens / step_s, flops / step_s / work.gpus / 1e12,
                    costs.mfu(flops, step_s, work.gpus, cluster.gpu.peak_flops))


def zero_sync_times(grads: float, plan: Plan, nmicros: int, cluster: Cluster):
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
    its span needs (intra-node inside a node, else inter-node)."""
    tp, dp, z, g = plan.tp, plan.dp, plan.zero_group, plan.zero_ngroups
    dp_link = _group_link(cluster, tp * dp)
    if not plan.zero:
        return costs.ring_all_reduce_time(grads, dp, dp_link), 0.0
    zero_link = _group_link(cluster, tp * z)
    reduce = costs.ring_all_gather_time(grads, z, zero_link)  # a reduce-scatter moves what an all-gather does
    reduce += costs.ring_all_reduce_time(grads / z, g, dp_link)
    if plan.zero == 3 and plan.pp > 1:
        reduce *= nmicros
    gathers = 1 if plan.zero == 1 else nmicros  # ZeRO-3: see the docstring
    return reduce, gathers * costs.ring_all_gather_time(grads, z, zero_link)
