"""Long context: transformers' Llama and Qwen2 (tiny configs, sdpa attention) train under context
parallelism exactly as in one process, in float64: every loss and every parameter after 3 Adam
steps within 1e-10 of single-process training on the global batch.

- ``cp`` 2 and ``cp`` 4: every op split along the sequence, attention as ring attention (causal rows
  balanced); a padded batch (attention mask with padding keys) under cp 2.
- ``cp`` 2 x dp 2 on 4 processes: each unit takes half of the batch, the loss is the mean over all
  tokens (the reference: gradient accumulation over the two halves, each loss / 2).
- mixture of experts (Mixtral, Qwen3-MoE) under ``cp`` 2, ``cp`` 2 x dp 2 (Qwen3-MoE also with
  use_zero=3), a pipeline of 2 stages each cp 2 (Mixtral, 4 processes) and cp 4 with ``ep_size`` 2
  (Mixtral: each rank stores 1/4 of the experts, the tokens exchanged inside groups of 2 ranks): the
  routed experts are split over the unit as ``ep`` splits them (rank 0 holds half of every expert weight; the generated
  code calls ring attention and the experts' exchange), the next-token and load-balancing losses
  exact (per replica under dp, as ``ep``); with ``pas_config={"ep_size": 1}`` every expert whole on
  each rank.
- DeepSeek-V3 under ``cp`` 2: multi-head latent attention (a value head size other than the
  query's; the key filled in place through head slices of a ``new_empty``, split along the sequence:
  each rank writes its own rows, no all-gather in any attention layer) and group-limited routing over
  experts split as under ``ep``.
"""
from __future__ import annotations

import glob
import re

import pytest

import model_plans as mp
from launch import run_workers
from test_hf_parity import _check

CP2 = [dict(mp.plan("cp2", "cp", 2), model="llama64"), dict(mp.plan("q-cp2", "cp", 2), model="qwen2"),
       dict(mp.plan("cp2-pad", "cp", 2, pad=True), model="llama64"),
       dict(mp.plan("m-cp2", "cp", 2), model="mixtral"), dict(mp.plan("q3-cp2", "cp", 2), model="qwen3_moe"),
       dict(mp.plan("m-cp2-ep1", "cp", 2, pas_config={"ep_size": 1}), model="mixtral"),
       dict(mp.plan("d-cp2", "cp", 2), model="deepseek_v3")]  # MLA: value head size != query's, key filled in place
WORLD4 = [dict(mp.plan("cp4", "cp", 4), model="llama64"), dict(mp.plan("cp2-dp2", "cp", 2), model="qwen2"),
          dict(mp.plan("cp2-dp2-zero3", "cp", 2, use_zero=3), model="llama64"),
          dict(mp.plan("m-cp2-dp2", "cp", 2), model="mixtral"), dict(mp.plan("q3-cp2-dp2", "cp", 2), model="qwen3_moe"),
          dict(mp.plan("q3-cp2-dp2-zero3", "cp", 2, use_zero=3), model="qwen3_moe"),
          dict(mp.plan("m-pp2-cp2", "cp", 4, use_end2end=True, pas_config={"pp_size": 2, "pipeline_nmicros": mp.NMICROS}),
               model="mixtral"),
          dict(mp.plan("m-cp4-ep2", "cp", 4, pas_config={"ep_size": 2}), model="mixtral")]
MOE = ("m-cp2", "q3-cp2", "m-cp2-dp2", "q3-cp2-dp2", "m-pp2-cp2")


def _activations_split(results, label):
    """Rank 0's local parameters are whole: cp splits activations, not weights."""
    return all(tuple(v.shape) == tuple(shape) for _, shape, _, v in results[0][label][1])


def _experts_split(results, label, n=2, rank=0):
    """`rank` holds its 1/n of every expert weight (piece `rank` % n, as under ``ep`` n) and every other
    weight whole."""
    shapes = [(name, tuple(shape), slices, tuple(v.shape)) for name, shape, slices, v in results[rank][label][1]]
    experts = [(full, tuple(slices[0]), local) for name, full, slices, local in shapes if ".experts." in name]
    piece = rank % n
    return (experts and all(local[0] * n == full[0] and local[1:] == full[1:]
                            and start == piece * local[0] and stop == (piece + 1) * local[0]
                            for full, (start, stop), local in experts)
            and all(full == local for name, full, _, local in shapes if ".experts." not in name))


def _generated(tmp_path, label):
    return [open(p).read() for p in glob.glob(str(tmp_path / "gen" / label / "**" / "gencode*.py"), recursive=True)]


def _attention_gathers(code):
    """{attention module: all-gathers in the lines the generated code attributes to it (its own ops)}."""
    module, gathers = None, {}
    for line in code.splitlines():
        source = re.match(r"\s*# \S+:\d+ in [\w.]+(?: \(([\w.]+)\))?: ", line)
        if source:
            module = source.group(1)
            if module and module.endswith(".self_attn"):
                gathers.setdefault(module, 0)
        elif module in gathers and "nr.comm.all_gather(" in line:
            gathers[module] += 1
    return gathers


@pytest.mark.multiprocess
@pytest.mark.slow
def test_cp2(tmp_path):
    results = run_workers(mp.run_plans, 2, CP2, str(tmp_path / "gen"), timeout=300)
    _check(results, CP2)
    assert _activations_split(results, "cp2")
    for label in ("cp2", "q-cp2", "cp2-pad", "d-cp2") + MOE[:2]:  # attention runs as ring attention on both ranks
        code = _generated(tmp_path, label)
        assert len(code) == 2 and all(c.count("nr.ring_attention.attention(") >= 2 for c in code), label
    for label in MOE[:2] + ("d-cp2",):  # the experts exchange their tokens as under ep
        assert _experts_split(results, label), label
        layers = 1 if label == "d-cp2" else 2  # DeepSeek-V3's first layer is dense
        assert all(c.count("nr.moe.expert_parallel(") == layers for c in _generated(tmp_path, label)), label
    assert _activations_split(results, "m-cp2-ep1")  # ep_size 1: every expert whole on each rank
    assert not any("nr.moe.expert_parallel(" in c for c in _generated(tmp_path, "m-cp2-ep1"))
    # DeepSeek-V3's key written in place on each rank's rows: no all-gather in either attention layer (the
    # key kept whole for its writes took 3 a layer: the like-tensor of new_empty and both written values)
    for code in _generated(tmp_path, "d-cp2"):
        gathers = _attention_gathers(code)
        assert len(gathers) == 2 and set(gathers.values()) == {0}, gathers


@pytest.mark.multiprocess
@pytest.mark.slow
def test_cp4_and_cp2_dp2(tmp_path):
    results = run_workers(mp.run_plans, 4, WORLD4, str(tmp_path / "gen"), timeout=400)
    # per replica (dp) or per micro-batch (the pipeline): the load-balancing loss of each half batch
    _check(results, WORLD4, halves_for=("cp2-dp2", "cp2-dp2-zero3", "q3-cp2-dp2-zero3") + MOE[2:])
    assert all(_experts_split(results, label) for label in MOE[2:])  # a pipeline stage's experts over its cp 2
    # ep_size 2 of cp 4: each rank stores 1/4 of every expert weight (the tokens exchanged inside pairs)
    assert all(_experts_split(results, "m-cp4-ep2", n=4, rank=r) for r in range(4))
    code = _generated(tmp_path, "m-cp4-ep2")
    assert len(code) == 4 and all(c.count("ep_size=2") == 2 for c in code)
