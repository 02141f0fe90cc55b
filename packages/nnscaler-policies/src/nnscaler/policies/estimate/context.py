"""Context parallelism (`Plan.cp`, the runtime's ``cp`` policy): every op split along the sequence
over cp ranks, attention as a ring (docs/autodist.md, "Long context").

Placement: cp follows tp (tp innermost, then cp, dp, pp), so a cp group spans tp·cp consecutive
GPUs: inside a node when tp·cp <= gpus_per_node, else every hop of the ring crosses nodes. Causal
balance: the sequence is cut into 2·cp equal chunks and rank i holds chunks i and 2cp-1-i
(zigzag), so every rank does 1/cp of the causal attention, 1/cp of it in each ring step.

The ring of one layer and micro-batch: forward, cp - 1 steps each passing a K/V block
(`kv_block_bytes`) to the next rank while the rank computes attention on the block it holds;
backward the same with the block's dK/dV as well (twice the bytes) against the backward's compute.
Each ring step also merges its block's result into the running one (online softmax: the fp32
output forward, dQ and the travelling dK/dV backward; memory-bound passes, `MERGE_PASSES`) and
launches its kernels (`STEP_OPS`): compute of the rank, on top of attention, growing as cp shrinks the
blocks. A step's transfer hides behind that step's work: exposed = max(0, transfer - step's work).
"""
from __future__ import annotations

from typing import List, Tuple

from nnscaler.ir import ConfigError

from . import costs
from .cluster import Cluster
from .model import ModelSpec

__all__ = ["LONG_SEQ", "MERGE_PASSES", "MIN_CP_TOKENS", "STEP_OPS", "check_cp", "cp_options", "kv_block_bytes",
           "merge_times", "ring_link", "ring_times"]

# The search offers cp > 1 only for sequences longer than LONG_SEQ (the length published runs pre-train at
# without cp, Llama 3's included; `--cp` forces it for shorter ones) and while a rank keeps at least
# MIN_CP_TOKENS tokens (smaller blocks: latency and GEMM shapes, not modelled, rule).
LONG_SEQ = 8192
MIN_CP_TOKENS = 1024
# A ring step's merge: read the running fp32 result, read the block's, write the running one (3 passes of
# 4 bytes an element): forward over the rank's output (b·s/cp·heads·head_dim), backward over dQ (as the
# output) and over the dK/dV that travel (as a K/V block).
MERGE_PASSES = 3
STEP_OPS = {"forward": 2, "backward": 3}  # kernels a ring step launches: attention (+ backward's dQ/dKV), merge


def check_cp(seq: int, cp, what: str = "--cp") -> None:
    """A cp degree must be a whole number >= 1 whose 2·cp zigzag chunks split the sequence evenly."""
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise ConfigError(f"{what} must be a whole number >= 1, got {cp!r}")
    if cp > 1 and seq % (2 * cp):
        fits = [c for c in (2 ** i for i in range(1, 9)) if seq % (2 * c) == 0]
        raise ConfigError(f"{what} {cp}: the sequence ({seq} tokens) must split into 2 x cp = {2 * cp} equal chunks "
                          f"(causal balance: cp rank i holds chunks i and {2 * cp - 1}-i); "
                          + (f"use a cp whose double divides {seq} (e.g. {', '.join(map(str, fits))}) or "
                             if fits else "")
                          + f"a --seq-len divisible by {2 * cp}")


def cp_options(seq: int, ranks: int) -> List[int]:
    """cp degrees the search tries for `ranks` GPUs left after tp: 1, and for a sequence longer than
    `LONG_SEQ` each divisor of `ranks` whose 2·cp chunks split it, leaving a rank `MIN_CP_TOKENS` or more."""
    if seq <= LONG_SEQ:
        return [1]
    return [c for c in range(1, ranks + 1) if ranks % c == 0
            and (c == 1 or (seq % (2 * c) == 0 and seq // c >= MIN_CP_TOKENS))]


def kv_block_bytes(spec: ModelSpec, b: int, seq: int, tp: int, cp: int, nbytes: int) -> float:
    """One ring block: a rank's K and V, b·(s/cp)·kv_local·(qk_dim + v_dim) elements (kv_local = the kv
    heads a tp rank holds: kv_heads / tp, at least one)."""
    return b * seq / cp * max(spec.kv_heads / tp, 1.0) * (spec.qk_dim + spec.v_dim) * nbytes


def ring_link(cluster: Cluster, tp: int, cp: int):
    """The link the cp ring uses: intra-node when its tp·cp GPUs fit a node, else inter-node."""
    return cluster.intra_node if tp * cp <= cluster.gpus_per_node else cluster.inter_node


def merge_times(spec: ModelSpec, b: int, seq: int, tp: int, cp: int, cluster: Cluster) -> Tuple[float, float]:
    """(forward s, backward s) a rank spends in one layer's ring steps besides attention: cp merges
    (`MERGE_PASSES`) and `STEP_OPS` launches a step; 0 without cp."""
    if cp <= 1:
        return 0.0, 0.0
    out = b * seq / cp * spec.heads / tp * spec.v_dim * 4  # the rank's output (and dQ) in fp32
    kv = kv_block_bytes(spec, b, seq, tp, cp, 4)  # a K/V block's dK/dV in fp32
    launch = cluster.op_overhead_us * 1e-6
    fwd = cp * (MERGE_PASSES * costs.memory_bound_time(out, cluster) + STEP_OPS["forward"] * launch)
    bwd = cp * (MERGE_PASSES * costs.memory_bound_time(out + kv, cluster) + STEP_OPS["backward"] * launch)
    return fwd, bwd


def ring_times(spec: ModelSpec, b: int, seq: int, tp: int, cp: int, work_fwd: float, work_bwd: float,
               cluster: Cluster) -> Tuple[float, float]:
    """(forward s, backward s) of one layer's ring transfers that compute does not hide; `work_fwd`,
    `work_bwd`: the rank's attention and merges of that layer (each ring step doing 1/cp of it)."""
    if cp <= 1:
        return 0.0, 0.0
    block, link = kv_block_bytes(spec, b, seq, tp, cp, cluster.gpu.dtype_bytes), ring_link(cluster, tp, cp)
    fwd = (cp - 1) * max(0.0, costs.p2p_time(block, link) - work_fwd / cp)
    bwd = (cp - 1) * max(0.0, costs.p2p_time(2 * block, link) - work_bwd / cp)
    return fwd, bwd
