"""Mixture-of-experts models of transformers (tiny Mixtral and Qwen2-MoE, built in code) train
under expert parallelism exactly as in one process, in float64: every loss (next-token loss plus
the router's load-balancing loss over the whole batch) and every parameter after 3 Adam steps
within 1e-10 of single-process training on the global batch.

- ``ep`` 2 on 2 processes: each rank holds half the experts of every layer (asserted on the
  local shapes) and half the tokens; the plan computes the whole batch (SPMD), so ``ep`` 2 equals
  one process, the auxiliary loss included.
- ``ep`` 2 x dp 2 on 4 processes: two units of 2, each with half the global batch. The auxiliary
  loss is then per replica (each unit's batch), so the reference is the mean over the two halves
  of the batch (gradient accumulation in one process: ``reference(halves=True)``).
- ``ep`` 2 + use_zero=3, ``ep`` with a pipeline (pp 2 x ep 2), and ``ep`` 2 with attention split
  Megatron-style over the same ranks (``tp_modules``).
- DeepSeek-V3 (sigmoid scores, group-limited top-2 with ``e_score_correction_bias``, a shared
  expert, latent attention) and gpt-oss (attention sinks, biased transposed experts, clamped
  SwiGLU) under ``ep`` 2 and ``ep`` 4 (DeepSeek-V3 under ``tp`` 2 and an interleaved pipeline of 4
  stages on 2 ranks too: no stage starts inside its attention's in-place key fill; and under pp 2 x
  ep 2 and ``hybrid`` pp 2 x 2 on 4 ranks, whose SDPA mask is a both-branch argument; both under
  ``ep`` 4 with ``ep_size`` 2, each rank storing 1/4 of the experts and exchanging tokens inside a
  pair, DeepSeek-V3 with its bias balancing): DeepSeek-V3's
  groups keep each token on one half of the experts, so under ``ep`` 2 a rank's experts often
  receive no row (it hung before the fix).
- ``dp`` and ``tp`` on the same models: the experts op splits along the tokens under tp (held to
  the float32 bar, 1e-5 relative: tp also splits HF's float32 router softmax and load-balancing
  sums, whose rounding then depends on the layout).
"""
from __future__ import annotations

import glob

import pytest

import model_plans as mp
from launch import run_workers
from test_hf_parity import _check


def _interleaved():
    case = mp.pp()
    case["cfg"] = dict(case["cfg"], pas_config=dict(case["cfg"]["pas_config"], pipeline_scheduler="1f1b_interleaved"))
    return case


FP32_TOL = 1e-5  # tp splits the router's float32 softmax (HF computes it in float32)
BALANCE = 0.01  # DeepSeek-V3's auxiliary-loss-free balancing: the router bias step

EP2 = [dict(mp.plan("ep2", "ep", 2), model="mixtral"), dict(mp.plan("ep2", "ep", 2), model="qwen2_moe", label="q-ep2"),
       dict(mp.tp(), model="mixtral", label="m-tp", tol=FP32_TOL), dict(mp.dp(), model="qwen2_moe", label="q-dp"),
       dict(mp.plan("ep2-attn-tp", "ep", 2, pas_config={"tp_modules": ["*.self_attn"]}), model="mixtral"),
       dict(mp.plan("d-ep2", "ep", 2), model="deepseek_v3"), dict(mp.plan("g-ep2", "ep", 2), model="gpt_oss"),
       dict(mp.plan("d-ep2-balanced", "ep", 2), model="deepseek_v3", balance=BALANCE),
       dict(mp.tp(), model="deepseek_v3", label="d-tp"),  # tp keeps the attention's in-place key writes whole
       dict(_interleaved(), model="deepseek_v3", label="d-pp2i")]  # 4 stages, none starting inside the key's fill
EP2_DP2 = [dict(mp.plan("ep2-dp2", "ep", 2), model="mixtral"),
           dict(mp.plan("d-ep4", "ep", 4), model="deepseek_v3"), dict(mp.plan("g-ep4", "ep", 4), model="gpt_oss"),
           # ep_size 2 of 4: each rank stores 1/4 of the experts, the tokens exchanged inside pairs of ranks
           dict(mp.plan("g-ep4-ep2", "ep", 4, pas_config={"ep_size": 2}), model="gpt_oss"),
           dict(mp.plan("d-ep4-ep2-balanced", "ep", 4, pas_config={"ep_size": 2}), model="deepseek_v3", balance=BALANCE),
           dict(mp.plan("d-ep2-dp2-balanced", "ep", 2), model="deepseek_v3", balance=BALANCE),
           dict(mp.plan("ep2-dp2-zero3", "ep", 2, use_zero=3), model="qwen2_moe"),
           dict(mp.plan("pp2-ep2", "ep", 4, use_end2end=True,
                        pas_config={"pp_size": 2, "pipeline_nmicros": mp.NMICROS}), model="mixtral"),
           # DeepSeek-V3's SDPA mask is a both-branch argument (a tensor or None): placed and generated alike
           dict(mp.plan("d-pp2-ep2", "ep", 4, use_end2end=True,
                        pas_config={"pp_size": 2, "pipeline_nmicros": mp.NMICROS}), model="deepseek_v3"),
           dict(mp.plan("d-hybrid", "hybrid", 4, use_end2end=True,
                        pas_config={"pp_size": 2, "pipeline_nstages": 2, "pipeline_pivots": "DeepseekV3DecoderLayer",
                                    "pipeline_nmicros": mp.NMICROS}), model="deepseek_v3")]


def _expert_shapes(results, label):
    """(full shape, local shape) of every expert weight on rank 0."""
    return {name: (tuple(shape), tuple(value.shape)) for name, shape, _, value in results[0][label][1]
            if ".experts." in name}


@pytest.mark.multiprocess
@pytest.mark.slow
def test_moe_ep2(tmp_path):
    results = run_workers(mp.run_plans, 2, EP2, str(tmp_path / "gen"), timeout=300)
    _check(results, EP2, halves_for=("q-dp",))  # dp: the load-balancing loss per replica
    for label in ("ep2", "q-ep2", "d-ep2", "g-ep2"):
        shapes = _expert_shapes(results, label)
        assert shapes and all(local[0] * 2 == full[0] and local[1:] == full[1:] for full, local in shapes.values()), shapes
    assert all(full == local for full, local in _expert_shapes(results, "m-tp").values())
    attention = {n: (tuple(full), tuple(v.shape)) for n, full, _, v in results[0]["ep2-attn-tp"][1]
                 if ".self_attn." in n and n.endswith("_proj.weight")}
    assert len(attention) == 8 and all(full != local for full, local in attention.values()), attention
    code = [open(p).read() for p in glob.glob(str(tmp_path / "gen" / "d-pp2i" / "**" / "gencode*.py"), recursive=True)]
    assert len(code) == 2 and all(c.count("def _stage_") == 2 for c in code)  # 2 stages on each of the 2 ranks


@pytest.mark.multiprocess
@pytest.mark.slow
def test_moe_ep2_dp2(tmp_path):
    results = run_workers(mp.run_plans, 4, EP2_DP2, str(tmp_path / "gen"), timeout=400)
    # per replica (dp) or per micro-batch (the pipeline): the load-balancing loss of each half batch
    _check(results, EP2_DP2, halves_for=("ep2-dp2", "ep2-dp2-zero3", "pp2-ep2", "d-ep2-dp2-balanced",
                                           "d-pp2-ep2", "d-hybrid"))
    for label, n in (("ep2-dp2", 2), ("pp2-ep2", 2), ("d-ep4", 4), ("g-ep4", 4)):  # rank 0's share of every expert weight
        shapes = _expert_shapes(results, label)
        assert shapes and all(local[0] * n == full[0] for full, local in shapes.values()), (label, shapes)
    for label in ("g-ep4-ep2", "d-ep4-ep2-balanced"):  # ep_size 2: every rank stores its 1/4, as under ep 4
        for rank in range(4):
            held = [(tuple(full), tuple(slices[0]), tuple(v.shape)) for name, full, slices, v in results[rank][label][1]
                    if ".experts." in name]
            assert held and all(local[0] * 4 == full[0] and (start, stop) == (rank * local[0], (rank + 1) * local[0])
                                for full, (start, stop), local in held), (label, rank, held)
    # DeepSeek-V3's one MoE layer is in the second stage (ranks 2, 3): each holds half its experts
    shapes = [(tuple(shape), tuple(value.shape)) for r in (2, 3)
              for name, shape, _, value in results[r]["d-pp2-ep2"][1] if ".experts." in name]
    assert shapes and all(local[0] * 2 == full[0] for full, local in shapes), shapes
