"""Bad inputs of the newer features (issue 45's list: ep, cp, use_zero=3, packed batches, the capacity
factor), each through the user's own call: the error names the culprit (the user's line, the config
key, the argument) and the fix, in one message with no internal traceback (cut at `parallelize`, no
chained cause). One process, code generation only (`load_module=False`), so any plan size runs."""
from __future__ import annotations

import os
import re
import traceback

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from nnscaler import ComputeConfig, parallelize
from nnscaler.ir import ConfigError, NnScalerError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Experts(nn.Module):
    """A router and `experts` experts through nnscaler.routed_experts (top-2), with `capacity_factor`."""

    def __init__(self, experts=4, capacity_factor=None):
        super().__init__()
        self.router = nn.Linear(8, experts, bias=False)
        self.up = nn.Parameter(torch.randn(experts, 16, 8) * 0.1)
        self.down = nn.Parameter(torch.randn(experts, 8, 8) * 0.1)
        self.capacity_factor = capacity_factor

    def forward(self, x):
        from nnscaler import routed_experts
        h = x.reshape(-1, 8)
        weights, index = self.router(h).softmax(-1).topk(2, dim=-1)
        return routed_experts(h, index, weights, self.up, self.down, capacity_factor=self.capacity_factor).square().mean()


class Attention(nn.Module):
    """Causal self-attention: one sdpa call, or op by op (`eager`), with `dropout`."""

    def __init__(self, eager=False, dropout=0.0):
        super().__init__()
        self.qkv, self.eager, self.dropout = nn.Linear(8, 24), eager, dropout

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 2, 4).permute(2, 0, 3, 1, 4)
        if self.eager:
            y = (q @ k.transpose(-1, -2)).softmax(-1) @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout)
        return y.square().mean()


Experts.__module__ = Attention.__module__ = __name__


def _assert_one_clean_message(info, at="parallelize"):
    """One message; the traceback ends at the user's call `at` (no internal frames); no chained cause."""
    assert "\n" not in str(info.value) and "Traceback" not in str(info.value), str(info.value)
    assert info.value.__cause__ is None and (info.value.__context__ is None or info.value.__suppress_context__)
    assert traceback.extract_tb(info.value.__traceback__)[-1].name == at


def _cfg(*args, **kwargs):
    return ComputeConfig(*args, trace_strategy="cpu", **kwargs)


PLANS = [  # (feature, model, input, policy, config, error, culprit and fix, as regexes)
    ("ep: experts not splitting", lambda: Experts(6), (4, 2, 8), "ep", _cfg(4, 4), NnScalerError,
     [r"routed_experts at .*test_feature_refusals.py:\d+ in Experts.forward", r"has 6 experts, which do not split "
      r"over the expert-parallel size 4", r"use an ep size that divides 6 \(e.g. plan_ngpus=3"]),
    ("ep: tokens not splitting", lambda: Experts(4), (3, 2, 8), "ep", _cfg(4, 4), NnScalerError,
     [r"in Experts.forward", r"receives 6 tokens when traced", r"make the micro-batch size times the sequence "
      r"length a multiple of 4"]),
    ("ep: a model without experts", lambda: Attention(), (2, 4, 8), "ep", _cfg(2, 2), NnScalerError,
     [r"pas_policy 'ep' found no routed-experts op in .*Attention", r"call nnscaler.routed_experts",
      r"or use another policy for a model without experts"]),
    ("cp: sequence not splitting", lambda: Attention(), (2, 6, 8), "cp", _cfg(2, 2), NnScalerError,
     [r"scaled_dot_product_attention at .*test_feature_refusals.py:\d+ in Attention.forward",
      r"has a sequence of 6 positions, which does not split into 4 equal chunks",
      r"make the sequence length a multiple of 4"]),
    ("cp: attention op by op", lambda: Attention(eager=True), (2, 8, 8), "cp", _cfg(2, 2), NnScalerError,
     [r"pas_policy 'cp' found no torch.nn.functional.scaled_dot_product_attention in .*Attention",
      r"softmax at .*test_feature_refusals.py:\d+ in Attention.forward", r"attn_implementation='sdpa'"]),
    ("cp: attention dropout", lambda: Attention(dropout=0.1), (2, 8, 8), "cp", _cfg(2, 2), NnScalerError,
     [r"in Attention.forward", r"runs dropout_p=0.1, which ring attention does not",
      r"set the model's attention dropout to 0"]),
    ("cp: ep_size", lambda: Attention(), (2, 8, 8), "cp", _cfg(2, 2, pas_config={"ep_size": 3}),
     ConfigError, [r"pas_config\['ep_size'\] must be a whole number dividing the 2 devices", r"got 3"]),
    ("use_zero=3: units matching nothing", lambda: Attention(), (2, 8, 8), "dp",
     _cfg(1, 2, use_zero=3, pas_config={"zero3_units": "Blok"}), ConfigError,
     [r"pas_config\['zero3_units'\]: 'Blok' matches no module of the model", r"module types there: Linear",
      r"or give a module path or a path glob"]),
    ("capacity factor: 0", lambda: Experts(4, capacity_factor=0), (4, 2, 8), "dp", _cfg(1, 1), ValueError,
     [r"routed_experts: capacity_factor must be a number > 0", r"e.g. 1.25\), or None for dropless routing",
      r"got 0$"]),
    ("capacity factor: a string", lambda: Experts(4, capacity_factor="1.25"), (4, 2, 8), "dp", _cfg(1, 1),
     ValueError, [r"capacity_factor must be a number > 0", r"got '1.25'$"]),
]


@pytest.mark.parametrize("feature, model, shape, policy, cfg, error, says", PLANS, ids=[p[0] for p in PLANS])
def test_refused_at_parallelize_naming_the_culprit_and_the_fix(tmp_path, feature, model, shape, policy, cfg,
                                                               error, says):
    torch.manual_seed(0)
    with pytest.raises(error) as info:
        parallelize(model(), {"x": torch.randn(*shape)}, policy, cfg, gen_savedir=tmp_path, load_module=False)
    for pattern in says:
        assert re.search(pattern, str(info.value)), (feature, pattern, str(info.value))
    _assert_one_clean_message(info)


def test_use_zero_stage_that_does_not_exist():
    with pytest.raises(ConfigError, match=r"ComputeConfig.use_zero must be False/0 \(no ZeRO\), True/1 .* or 3") \
            as info:
        ComputeConfig(1, 2, use_zero=2)
    assert "\n" not in str(info.value) and info.value.__cause__ is None


def test_capacity_factor_refused_where_it_is_set():
    """`set_capacity_factor` refuses a bad factor at the call, not when the model is traced later."""
    from nnscaler.ir import set_capacity_factor
    for bad in (-1, 0, "1.25", True, float("nan")):
        with pytest.raises(ConfigError, match=r"^nnscaler.ir.set_capacity_factor\(model, .*\): the capacity factor "
                                              r"must be a number > 0 .* e.g. 1.25\), or None for dropless routing$") \
                as info:
            set_capacity_factor(Experts(), bad)
        _assert_one_clean_message(info, at="set_capacity_factor")
    assert set_capacity_factor(Experts(), 1.25) == 0 and set_capacity_factor(Experts(), None) == 0  # no HF experts


def test_packed_batches_option_that_is_not_a_boolean(tmp_path):
    """TokenizedText's `pack` (packed documents): a non-boolean is refused naming the config key."""
    from nnscaler.trainer import TrainerConfigError
    from nnscaler.trainer.hf import TokenizedText
    (tmp_path / "doc.txt").write_text("one document")
    with pytest.raises(TrainerConfigError, match=r"dataset.train_args.pack.*'yes': use true \(documents kept apart\) "
                                                 r"or false") as info:
        TokenizedText(str(tmp_path / "doc.txt"), os.path.join(ROOT, "examples", "trainer", "hf_llama"),
                      block_size=4, pack="yes")
    assert "\n" not in str(info.value) and info.value.__cause__ is None
