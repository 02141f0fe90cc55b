"""The analytic cost model's parts: roofline op times, ring collectives, the 1F1B bubble, memory
with ZeRO and recomputation, and the MFU formula. Pure functions of numbers; every constant is
stated here and in docs/autodist.md ("Planning a cluster you do not have").
"""
from __future__ import annotations

import math
from typing import Dict, Optional

from .cluster import Cluster, Link

__all__ = ["EFFICIENCY", "USABLE_MEMORY", "GiB", "GEMM_TILE", "K_SPLIT_MIN", "efficiency", "gemm_shape_efficiency", "matmul_time",
           "memory_bound_time",
           "attention_time", "unfused_attention_time", "ring_all_reduce_time", "ring_all_gather_time",
           "all_to_all_time", "split_all_to_all_time", "p2p_time",
           "bubble_fraction",
           "interleaved_activation_factor",
           "optimizer_bytes_per_param", "model_flops", "attention_flops_per_token", "mfu"]

GiB = 1024 ** 3

# Fractions of the described peak each op class reaches (not fitted to any run; docs give sources):
# - matmul: large bf16 GEMMs under cuBLAS run at about 70-85 % of the dense peak on A100 / H100
#   (NVIDIA's cuBLAS benchmarks; Narayanan et al. 2021 report ~ 90 % for their largest GEMMs on A100).
# - attention: FlashAttention-2 (Dao 2023) reaches 50-73 % of A100 peak forward and less backward;
#   0.5 for forward + backward together.
# - memory: streaming kernels (norms, elementwise, Adam) reach about 80 % of the HBM data-sheet bandwidth.
EFFICIENCY: Dict[str, float] = {"matmul": 0.80, "attention": 0.50, "memory": 0.80}
# Share of a GPU's memory a plan may fill: the rest is the CUDA context, NCCL buffers and allocator
# fragmentation (a few GB on an 80 GB GPU).
USABLE_MEMORY = 0.92
OPS_PER_LAYER = 20  # ops of one decoder layer's forward (norms, projections, rotary, attention, adds); backward 2x
ATTENTION_BACKWARD = 2.5  # FlashAttention's backward does 5 matmuls of the forward's 2 (recomputing the scores)
# Without a fused kernel (a cluster's `fused_attention: false`) the b·heads·s² scores are materialised:
# QKᵀ writes them, the fused scale-mask-softmax reads and writes them, dropout reads and writes them,
# PV reads them: 6 passes forward; backward twice the forward (4 matmuls of its 2, twice the passes).
SCORE_PASSES = 6


def efficiency(cluster: Cluster, kind: str) -> float:
    return cluster.efficiency.get(kind, EFFICIENCY[kind])


# A GEMM's shape (NVIDIA, "Matrix Multiplication Background User's Guide", Deep Learning Performance
# docs: "Tile quantization" and "Wave quantization"): the library computes the m x n output in tiles,
# each on one SM, in waves of `sms` tiles. A dimension that is not a multiple of the tile computes the
# padded remainder for nothing (tile quantization: m·n over the padded tiles' area), and a last wave
# with fewer tiles than SMs leaves the others idle (wave quantization: work units over waves x SMs).
# Fewer tiles than SMs are split along k when k is long (split-K, CUTLASS's "Split-K" and "Stream-K"
# parallel reductions): up to sms / tiles parts of at least K_SPLIT_MIN each. GEMM_TILE is 128 x 128, a
# middle of the 64 .. 256 tiles cuBLAS picks. `EFFICIENCY['matmul']` is the rate of a large GEMM's busy
# tiles; thin and small GEMMs (a tensor-parallel slice of a small expert, an expert with few tokens, the
# router's E columns) fall below it by these factors. A grouped GEMM (the experts of a layer in one
# launch) fills its waves with every group's tiles.
GEMM_TILE = (128, 128)
K_SPLIT_MIN = 512


def gemm_shape_efficiency(m: float, n: float, k: float, cluster: Cluster, groups: int = 1) -> float:
    """The fraction of a large GEMM's rate that `groups` GEMMs of (m x k) @ (k x n) in one launch reach:
    tile x wave quantization, split-K below a wave (1 when the cluster's GPU has no SM count, e.g.
    ``--cluster local``)."""
    sms = cluster.gpu.sms
    if not sms or m <= 0 or n <= 0:
        return 1.0
    rows, cols = math.ceil(m / GEMM_TILE[0]), math.ceil(n / GEMM_TILE[1])
    tile = m * n / (rows * GEMM_TILE[0] * cols * GEMM_TILE[1])
    tiles = groups * rows * cols
    units = tiles * (max(1, min(sms // tiles, int(k // K_SPLIT_MIN))) if tiles < sms else 1)
    return tile * units / (math.ceil(units / sms) * sms)


def matmul_time(m: float, k: float, n: float, cluster: Cluster, groups: int = 1) -> float:
    """`groups` (m x k) @ (k x n) in one launch (1: a plain GEMM; the local experts' grouped GEMM): the
    slower of their FLOPs at the matmul peak x the shape's efficiency (`gemm_shape_efficiency`) and their
    bytes at the memory bandwidth (roofline)."""
    gpu = cluster.gpu
    flops = 2.0 * m * k * n * groups
    moved = (m * k + k * n + m * n) * gpu.dtype_bytes * groups
    rate = gpu.peak_flops * efficiency(cluster, "matmul") * gemm_shape_efficiency(m, n, k, cluster, groups)
    return max(flops / rate, moved / (gpu.memory_gbps * 1e9 * efficiency(cluster, "memory")))


def memory_bound_time(nbytes: float, cluster: Cluster) -> float:
    return nbytes / (cluster.gpu.memory_gbps * 1e9 * efficiency(cluster, "memory"))


def attention_time(batch: float, seq: int, heads: float, head_dim: int, cluster: Cluster) -> float:
    """Forward of causal flash attention over `heads` local heads: 4·b·s²·heads·head_dim FLOPs, half
    of them skipped by the causal mask."""
    flops = 4.0 * batch * seq * seq * heads * head_dim * 0.5
    return flops / (cluster.gpu.peak_flops * efficiency(cluster, "attention"))


def unfused_attention_time(batch: float, seq: int, heads: float, head_dim: int, cluster: Cluster,
                           rows: Optional[float] = None) -> float:
    """Forward of attention without a fused kernel over `heads` local heads and `rows` query rows
    (default seq) against seq keys: QKᵀ and PV as batched matmuls at the matmul efficiency, the
    causal mask skipping nothing (4·b·rows·s·heads·head_dim FLOPs), and `SCORE_PASSES` passes over
    the b·heads·rows·s scores at the memory bandwidth."""
    rows = seq if rows is None else rows
    flops = 4.0 * batch * rows * seq * heads * head_dim
    scores = batch * heads * rows * seq * cluster.gpu.dtype_bytes
    return flops / (cluster.gpu.peak_flops * efficiency(cluster, "matmul")) \
        + SCORE_PASSES * memory_bound_time(scores, cluster)


def ring_all_reduce_time(nbytes: float, n: int, link: Link) -> float:
    """Ring all-reduce of `nbytes` over `n` ranks: 2(n-1)/n · bytes / bandwidth + 2(n-1) latencies."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (n - 1) / n * nbytes / link.bytes_per_s + 2 * (n - 1) * link.latency_s


def ring_all_gather_time(nbytes: float, n: int, link: Link) -> float:
    """Ring all-gather (or reduce-scatter) of a `nbytes` whole: (n-1)/n · bytes / bandwidth + (n-1) latencies."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return (n - 1) / n * nbytes / link.bytes_per_s + (n - 1) * link.latency_s


def all_to_all_time(nbytes: float, n: int, link: Link) -> float:
    """All-to-all over `n` ranks of a rank's `nbytes` (1/n of it to each rank, itself included): the
    (n-1)/n that leaves, sent and received at once, / bandwidth + (n-1) latencies (one message a peer)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return (n - 1) / n * nbytes / link.bytes_per_s + (n - 1) * link.latency_s


def split_all_to_all_time(nbytes: float, n: int, per_node: int, intra: Link, inter: Link) -> float:
    """All-to-all over `n` ranks spread over nodes, `per_node` of them in each: of a rank's `nbytes`, the
    (n - per_node)/n bound for other nodes leave on the inter-node link while the (per_node - 1)/n for its
    node's others go over the intra-node link at the same time (the slower of the two) + (n-1) latencies
    of the inter-node link."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    per_node = max(1, min(per_node, n))
    return max((n - per_node) / n * nbytes / inter.bytes_per_s, (per_node - 1) / n * nbytes / intra.bytes_per_s) \
        + (n - 1) * inter.latency_s


def p2p_time(nbytes: float, link: Link) -> float:
    return link.latency_s + nbytes / link.bytes_per_s


def bubble_fraction(pp: int, nmicros: int, virtual: int = 1) -> float:
    """The idle share of a 1F1B step: (pp - 1) / (nmicros + pp - 1); interleaved with `virtual`
    stages per GPU, the bubble shrinks `virtual` times: (pp - 1) / (virtual · nmicros + pp - 1)."""
    return (pp - 1) / (virtual * nmicros + pp - 1)


def interleaved_activation_factor(pp: int, virtual: int) -> float:
    """Activations the first GPU keeps under interleaved 1F1B relative to plain 1F1B:
    1 + (pp - 1) / (pp · virtual) (Korthikanti et al. 2022, section 4.2.3); 1 without interleaving."""
    return 1.0 if virtual <= 1 else 1.0 + (pp - 1) / (pp * virtual)


def optimizer_bytes_per_param(dtype: str) -> int:
    """Adam's state per parameter: m and v in fp32, plus fp32 master weights when training in bf16."""
    return 8 + (4 if dtype == "bf16" else 0)


def attention_flops_per_token(layers: int, heads: int, head_dim: int, seq: int) -> float:
    """Forward + backward attention FLOPs per token (scores and weighted sum, no causal saving, as
    PaLM's MFU and Megatron-LM count): 12 · layers · heads · head_dim · seq."""
    return 12.0 * layers * heads * head_dim * seq


def model_flops(params: int, tokens: float, layers: int, heads: int, head_dim: int, seq: int) -> float:
    """Model FLOPs of a training step: 6·N·tokens plus the attention FLOPs (recomputation not counted)."""
    return 6.0 * params * tokens + attention_flops_per_token(layers, heads, head_dim, seq) * tokens


def mfu(flops: float, step_s: float, gpus: int, peak_flops: float) -> float:
    """Model FLOPs utilization: the step's model FLOPs over what the GPUs' peak could do in it."""
    if step_s <= 0 or not math.isfinite(step_s):
        return 0.0
    return flops / (step_s * gpus * peak_flops)
