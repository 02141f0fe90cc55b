"""The analytic cost model's parts (nnscaler.policies.estimate.costs) against hand-computed values."""
from __future__ import annotations

import dataclasses

import pytest

from nnscaler.policies.estimate import costs, load_cluster
from nnscaler.policies.estimate.cluster import Link


@pytest.fixture(scope="module")
def h100():
    return load_cluster("h100-sxm")


def test_matmul_roofline(h100):
    # compute bound: 2 * 4096^3 FLOPs at 80 % of 989 TFLOP/s, x the last wave's idle SMs: 32 x 32 tiles of
    # 128 x 128 in 8 waves of H100's 132 SMs
    assert costs.matmul_time(4096, 4096, 4096, h100) == pytest.approx(2 * 4096 ** 3 / (989e12 * 0.8 * 1024 / 1056))
    # memory bound: a vector times a matrix moves (4096 + 4096^2 + 4096) bf16 values at 80 % of 3350 GB/s
    assert costs.matmul_time(1, 4096, 4096, h100) == pytest.approx((2 * 4096 + 4096 ** 2) * 2 / (3350e9 * 0.8))


def test_gemm_shape_efficiency(h100):
    """Tile and wave quantization (NVIDIA's Matrix Multiplication Background guide), split-K below a wave:
    a thin or small GEMM runs below a large one's rate; a grouped GEMM fills its waves with every group's
    tiles."""
    eff = costs.gemm_shape_efficiency
    assert eff(132 * 128, 128, 4096, h100) == 1.0  # whole tiles, one full wave
    assert eff(8192, 8192, 4096, h100) == pytest.approx(4096 / (32 * 132))  # 4096 tiles: the 32nd wave part-idle
    assert eff(64, 4096, 4096, h100) == pytest.approx(0.5 * 128 / 132)  # 64 tokens: half a tile; 32 tiles x split 4
    assert eff(4096, 8, 512, h100) == pytest.approx(8 / 128 * 32 / 132)  # the router's 8 columns; k too short to split
    # 8 experts of 256 tokens, width 96 (a tp 8 slice of 768), k 2048: 2 tiles each, 16 in one launch, split 4
    assert eff(256, 96, 2048, h100, groups=8) == pytest.approx(96 / 128 * 64 / 132)
    local = dataclasses.replace(h100, gpu=dataclasses.replace(h100.gpu, sms=None))
    assert eff(64, 8, 64, local) == 1.0  # no SM count (--cluster local): shapes not priced
    # 16 experts of width 768 (gated), 2048 tokens each: a tp 8 slice (192 columns) runs at 0.73 of the
    # rate of the whole (0.97), and takes well over an eighth of its time (the slice's weights are read too)
    assert eff(2048, 192, 2048, h100, groups=16) == pytest.approx(0.75 * 512 / 528)
    assert eff(2048, 1536, 2048, h100, groups=16) == pytest.approx(3072 / (24 * 132))
    whole, slice8 = (costs.matmul_time(2048, 2048, 2 * 768 / tp, h100, groups=16) for tp in (1, 8))
    assert slice8 > 1.5 * whole / 8


def test_attention_is_half_the_causal_flops(h100):
    assert costs.attention_time(2, 1024, 8, 128, h100) == pytest.approx(4 * 2 * 1024 ** 2 * 8 * 128 * 0.5 / (989e12 * 0.5))


def test_ring_collectives():
    link = Link(450, 3)
    assert costs.ring_all_reduce_time(1e9, 8, link) == pytest.approx(2 * 7 / 8 * 1e9 / 450e9 + 14 * 3e-6)
    assert costs.ring_all_gather_time(1e9, 8, link) == pytest.approx(7 / 8 * 1e9 / 450e9 + 7 * 3e-6)
    assert costs.ring_all_reduce_time(1e9, 1, link) == 0.0
    assert costs.p2p_time(1e6, Link(50, 10)) == pytest.approx(1e-5 + 1e6 / 50e9)


def test_bubble_fraction():
    assert costs.bubble_fraction(4, 12) == pytest.approx(3 / 15)
    assert costs.bubble_fraction(1, 12) == 0.0
    assert costs.bubble_fraction(4, 12, virtual=2) == pytest.approx(3 / 27)
    assert costs.interleaved_activation_factor(4, 2) == pytest.approx(1 + 3 / 8)
    assert costs.interleaved_activation_factor(4, 1) == 1.0


def test_mfu_formula():
    flops = costs.model_flops(params=10 ** 9, tokens=10 ** 6, layers=10, heads=16, head_dim=64, seq=1024)
    assert flops == pytest.approx(6e15 + 12 * 10 * 16 * 64 * 1024 * 1e6)
    assert costs.mfu(6e15, step_s=10.0, gpus=8, peak_flops=1e14) == pytest.approx(0.75)
    assert costs.mfu(6e15, step_s=0.0, gpus=8, peak_flops=1e14) == 0.0


def test_optimizer_state_bytes():
    assert costs.optimizer_bytes_per_param("bf16") == 12  # fp32 master weights, m, v
    assert costs.optimizer_bytes_per_param("fp32") == 8


def test_cluster_efficiency_overrides_the_default(h100):
    import dataclasses
    slow = dataclasses.replace(h100, efficiency={"matmul": 0.4})
    assert costs.matmul_time(4096, 4096, 4096, slow) == pytest.approx(2 * costs.matmul_time(4096, 4096, 4096, h100))
