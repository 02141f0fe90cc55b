"""One decoder layer's (and the output head's) time on one micro-batch, from the analytic costs: the
matrix products (an MoE layer's experts as grouped GEMMs), attention (fused or not, its 1/cp share
under context parallelism, the ring's merges), the elementwise passes, Megatron tensor parallelism's
collectives, the exposed ring transfers, and an MoE layer's dispatch and combine all-to-alls; the link
a group of consecutive ranks uses. `plan_cost.estimate_plan` adds them up per pipeline GPU."""
from __future__ import annotations

from . import context, costs
from .cluster import Cluster
from .model import ModelSpec

__all__ = ["group_link", "layer_times", "moe_mlp", "all_to_all_time", "head_times"]


def group_link(cluster: Cluster, span: int):
    """The link a group uses whose members lie within `span` consecutive ranks."""
    return cluster.intra_node if span <= cluster.gpus_per_node else cluster.inter_node


def layer_times(spec: ModelSpec, b: int, seq: int, tp: int, cluster: Cluster, moe: tuple = (), cp: int = 1):
    """(forward s, backward s, tp comm s per forward pass, (forward, backward) exposed ring s) of one
    decoder layer on one micro-batch's s/cp tokens; `moe`: (ep, imbalance) for an MoE layer."""
    m = b * seq / cp
    h, hd = spec.hidden, spec.attn_dim
    # q, k, v (MLA: through the latents) split by heads, the output projection split on its input
    mats = [(1, m, k / tp if split == "row" else k, n / tp if split == "col" else n)
            for k, n, split in spec.attention_projections()]
    if moe:
        mlp_mats, mlp_elements = moe_mlp(spec, m, tp, *moe)
    else:
        mlp_mats = [(1, m, h, (2 if spec.gated else 1) * spec.ffn / tp),  # up (and gate)
                    (1, m, spec.ffn / tp, h)]  # down
        mlp_elements = (3 if spec.gated else 2) * spec.ffn
    mm = sum(costs.matmul_time(*shape, cluster, groups=n) for n, *shape in mats + mlp_mats)  # n: a grouped GEMM
    if cluster.fused_attention:  # the causal attention balanced over cp (zigzag): 1/cp of it a rank
        att = costs.attention_time(b, seq, spec.heads / tp, hd, cluster) / cp
        att_b = costs.ATTENTION_BACKWARD * att
    else:  # the rank's s/cp query rows against all s keys; backward twice the forward
        att = costs.unfused_attention_time(b, seq, spec.heads / tp, hd, cluster, rows=seq / cp)
        att_b = 2 * att
    merge_f, merge_b = context.merge_times(spec, b, seq, tp, cp, cluster)  # the ring steps' merges (0 without cp)
    att, att_b = att + merge_f, att_b + merge_b
    # norms, residual adds, rotary on q and k, the MLP activation: elements read + written per token
    elementwise = 10 * h + spec.rotary_elements + mlp_elements
    ew = costs.memory_bound_time(m * elementwise / tp * cluster.gpu.dtype_bytes, cluster)
    fwd = mm + att + ew
    bwd = 2 * mm + att_b + 2 * ew
    # Megatron TP (sequence parallel): 2 all-gathers + 2 reduce-scatters of b·s·h a pass (= 2 all-reduces)
    comm = 2 * costs.ring_all_reduce_time(m * h * cluster.gpu.dtype_bytes, tp, cluster.intra_node)
    return fwd, bwd, comm, context.ring_times(spec, b, seq, tp, cp, att, att_b, cluster)


def moe_mlp(spec: ModelSpec, m: int, tp: int, ep: int, imbalance: float):
    """An MoE layer's MLP on one rank of m tokens: ([(groups, m, k, n) matmuls], elementwise elements a
    token). The router; E / ep local experts as one grouped GEMM per projection, each expert on m·k·ep / E
    tokens (x imbalance on the busiest rank), their width split over tp (the shapes price what small
    and thin GEMMs lose: `costs.gemm_shape_efficiency`); the shared experts on every token; the
    activation's elements; the router's softmax, top-k and weights over E (read and written, 4 passes);
    the dispatch's permute and the combine's un-permute (a read and a write of k copies of the token,
    twice)."""
    h, f, s, w = spec.hidden, spec.expert_ffn, spec.shared_ffn, 2 if spec.gated else 1
    local, per_expert = spec.experts // ep, m * spec.top_k * ep / spec.experts * imbalance
    mats = [(1, m / tp, h, spec.experts),  # router (on the sequence-parallel shard)
            (local, per_expert, h, w * f / tp), (local, per_expert, f / tp, h)]
    if s:
        mats += [(1, m, h, w * s / tp), (1, m, s / tp, h)]
    act = (w + 1) * (spec.top_k * f * imbalance + s)
    return mats, act + 4 * spec.top_k * h + 4 * spec.experts


def all_to_all_time(spec: ModelSpec, b: int, seq: int, tp: int, ep: int, cluster: Cluster, cp: int = 1) -> float:
    """Dispatch + combine of one forward pass of an MoE layer: two all-to-alls over ep ranks, each of the
    rank's b·s/(cp·tp) tokens (sequence parallel) x top_k copies x hidden. An ep group is tp·ep
    consecutive ranks (ep consecutive dp ranks, or cp ranks with context parallelism): inside a node, the
    intra-node link; across nodes, the share for other nodes on the inter-node link and the share for
    the node's own gpus_per_node / tp ranks on the intra-node link, at once."""
    nbytes = b * seq / cp / tp * spec.top_k * spec.hidden * cluster.gpu.dtype_bytes
    if tp * ep <= cluster.gpus_per_node:
        return 2 * costs.all_to_all_time(nbytes, ep, cluster.intra_node)
    return 2 * costs.split_all_to_all_time(nbytes, ep, cluster.gpus_per_node // tp, cluster.intra_node,
                                           cluster.inter_node)


def head_times(spec: ModelSpec, b: int, seq: int, tp: int, cluster: Cluster, cp: int = 1):
    """(forward s, backward s) of the output projection and the loss over fp32 logits (vocab split over tp)."""
    m = b * seq / cp
    mm = costs.matmul_time(m, spec.hidden, spec.vocab / tp, cluster)
    loss = costs.memory_bound_time(m * spec.vocab / tp * 4 * 4, cluster)  # cast, softmax, grad: ~4 fp32 passes
    return mm + loss / 2, 2 * mm + loss / 2
