"""Precision: parsing, per tensor type casts (apply_precision), bf16 training and autocast.

Master weights, the grad scaler and data parallelism: test_precision_training.py (which imports
the helpers below).

Tolerances (bf16 keeps 8 significant bits: unit roundoff u = 2**-8 ~= 3.9e-3; fp16 keeps 11:
u = 2**-11 ~= 4.9e-4):

- BF16_TRUE_LOSS_RTOL = 2e-2 (~5u), bf16-true loss vs the fp32 run. Weights, inputs and every
  layer's output are rounded to bf16 (~u of relative error each, 3 layers and the loss), so the
  loss carries a few u; measured <= 5.1e-3 over 10 Adam steps.
- STEP0_LOSS_RTOL = 1e-5: a bf16-mixed step-0 loss against the same computation under
  torch.autocast (see test_precision_training.py); a run in fp32 instead of bf16 differs by ~6e-4.
"""
from __future__ import annotations

import collections
import copy
import dataclasses
import pickle

import pytest
import torch
import torch.nn.functional as F

import toy_models
from nnscaler.runtime.errors import ConfigError
from nnscaler.runtime.module import ParallelModule
from nnscaler.runtime.optimizer import build_optimizer
from nnscaler.runtime.precision import (MixedPrecisionOptimizer, PrecisionConfig, apply_precision, cast_inputs,
                                        get_precision, parse_precision, remove_precision, with_master_weights)
from nnscaler.runtime.optimizer_state import optimizer_state


F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
LR, STEPS, N = 1e-3, 3, 8
BF16_TRUE_LOSS_RTOL = 2e-2
STEP0_LOSS_RTOL = 1e-5


def make_mlp():
    torch.manual_seed(0)
    return toy_models.MLP()


def batch(step, n=N):
    return toy_models.mlp_batch(step, n)


def train(model, opt, steps, scaler=None, autocast=None, n=N):
    """Plain loop; returns the losses and the gradients of the first step (fp32, by name)."""
    losses, first = [], None
    for s in range(steps):
        opt.zero_grad()
        if autocast is not None:
            with torch.autocast("cpu", dtype=autocast):
                loss = model(**batch(s, n))
        else:
            loss = model(**batch(s, n))
        (scaler.scale(loss) if scaler else loss).backward()
        if s == 0:
            first = {k: p.grad.detach().float().clone() for k, p in model.named_parameters()}
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        losses.append(loss.item())
    return losses, first


# -- parsing ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, param, buffer, inp, mixed, compute, scaler", [
    ("32-true", F32, F32, F32, False, F32, False),
    ("16-true", F16, F16, F16, False, F16, True),
    ("bf16-true", BF16, BF16, BF16, False, BF16, False),
    ("16-mixed", F32, F32, None, True, F16, True),
    ("bf16-mixed", F32, F32, None, True, BF16, False),
    ("fp32", F32, F32, F32, False, F32, False),
    ("fp16", F16, F16, F16, False, F16, True),
    ("bf16", BF16, BF16, BF16, False, BF16, False),
    ("none", None, None, None, False, None, False),
    (" BF16-Mixed ", F32, F32, None, True, BF16, False),
])
def test_parse_names(name, param, buffer, inp, mixed, compute, scaler):
    cfg = parse_precision(name)
    assert (cfg.param, cfg.buffer, cfg.input, cfg.mixed, cfg.compute_dtype, cfg.grad_scaler) == \
        (param, buffer, inp, mixed, compute, scaler)


def test_parse_dict_none_and_config():
    assert parse_precision(None) == PrecisionConfig() and PrecisionConfig().is_noop
    cfg = parse_precision({"param": "bf16", "buffer": "fp32", "input": "none"})
    assert (cfg.param, cfg.buffer, cfg.input, cfg.mixed, cfg.grad_scaler) == (BF16, F32, None, False, False)
    cfg = parse_precision({"param": "fp16"})  # missing tensor types: no conversion
    assert (cfg.param, cfg.buffer, cfg.input, cfg.grad_scaler) == (F16, None, None, True)
    assert parse_precision({"input": torch.bfloat16, "buffer": None}).input == BF16
    assert parse_precision(cfg) is cfg
    assert dataclasses.replace(cfg, grad_scaler=False).grad_scaler is False
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.param = F32
    assert parse_precision("16-mixed").describe() == "param fp32, buffer fp32, input none, mixed fp16, grad scaler"


def test_parse_errors():
    with pytest.raises(ValueError, match=r"unknown tensor type 'weight': allowed keys are 'param', 'buffer', 'input'"):
        parse_precision({"param": "bf16", "weight": "fp32"})
    with pytest.raises(ValueError, match=r"precision\['buffer'\] = 'fp8' is not a precision: allowed values are "
                                         r"'fp32', 'fp16', 'bf16', 'none'"):
        parse_precision({"param": "bf16", "buffer": "fp8"})
    with pytest.raises(ValueError, match=r"precision\['param'\] = torch.float64"):
        parse_precision({"param": torch.float64})
    with pytest.raises(ValueError, match=r"precision '16' is not supported: .*'32-true', '16-true', 'bf16-true', "
                                         r"'16-mixed', 'bf16-mixed'"):
        parse_precision("16")  # Lightning's legacy aliases are ambiguous with the seed's 'bf16'
    with pytest.raises(ValueError, match="must be None, a str or a dict, got int 32"):
        parse_precision(32)
    with pytest.raises(ConfigError, match=r"mixed=True\) needs compute_dtype"):
        PrecisionConfig(F32, F32, None, mixed=True, compute_dtype=F32)
    with pytest.raises(ConfigError, match=r"PrecisionConfig.param = torch.float64"):
        PrecisionConfig(param=torch.float64)


# -- apply_precision ----------------------------------------------------------------------------------

Pair = collections.namedtuple("Pair", "a b")


class Probe(torch.nn.Module):
    """Records the dtypes of its inputs and whether autocast is on inside forward."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.register_buffer("running", torch.ones(4))
        self.register_buffer("count", torch.zeros((), dtype=torch.long))
        self.register_buffer("scratch", torch.ones(2), persistent=False)
        self.seen = None

    def forward(self, x, extra=None, *, nested=None, ids=None):
        self.seen = dict(x=x.dtype, extra=extra, nested=nested, ids=ids.dtype if ids is not None else None,
                         autocast=torch.is_autocast_enabled("cpu"),
                         autocast_dtype=torch.get_autocast_dtype("cpu"))
        return self.fc(x) * self.running, {"half": x.to(BF16), "ids": ids}


def dtypes(obj):
    if isinstance(obj, torch.Tensor):
        return obj.dtype
    if isinstance(obj, Pair):
        return Pair(*map(dtypes, obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map(dtypes, obj))
    if isinstance(obj, dict):
        return {k: dtypes(v) for k, v in obj.items()}
    return obj


def test_apply_precision_casts_params_buffers_and_inputs():
    m = Probe()
    weight = m.fc.weight
    m(torch.randn(2, 4)).__getitem__(0).sum().backward()  # a gradient to cast along
    assert apply_precision(m, "bf16-true") is m
    assert m.fc.weight is weight and weight.dtype == BF16 and weight.grad.dtype == BF16  # same Parameter
    assert (m.fc.bias.dtype, m.running.dtype, m.scratch.dtype, m.count.dtype) == (BF16, BF16, BF16, torch.long)
    assert get_precision(m) == parse_precision("bf16-true")
    ids = torch.arange(2)
    out, extra = m(torch.randn(2, 4, dtype=torch.float64), [torch.randn(1), Pair(torch.randn(1), 3)],
                   nested={"a": (torch.randn(1, dtype=F16),), "b": "text"}, ids=ids)
    assert m.seen["x"] == BF16 and dtypes(m.seen["extra"]) == [BF16, Pair(BF16, 3)]
    assert dtypes(m.seen["nested"]) == {"a": (BF16,), "b": "text"} and m.seen["ids"] == torch.long
    assert not m.seen["autocast"] and out.dtype == BF16 and extra["ids"] is ids


def test_apply_precision_per_tensor_type():
    m = Probe()
    apply_precision(m, {"param": "fp16", "buffer": "fp32", "input": "none"})
    assert (m.fc.weight.dtype, m.running.dtype) == (F16, F32)
    x = torch.randn(2, 4, dtype=torch.float64)
    with pytest.raises(RuntimeError):  # inputs are not converted: float64 meets fp16 weights
        m(x)
    assert m.seen["x"] == torch.float64
    apply_precision(m, {"input": "fp16"})  # replaces the previous hook; dtypes already cast stay
    m(x)
    assert m.seen["x"] == F16 and m.fc.weight.dtype == F16
    assert cast_inputs({"x": x, "n": torch.arange(3)}, "bf16")["x"].dtype == BF16
    assert cast_inputs({"n": torch.arange(3)}, "bf16")["n"].dtype == torch.long
    assert cast_inputs(x, {"param": "bf16"}) is x


def test_apply_precision_mixed_and_remove():
    m = Probe()
    apply_precision(m, "bf16-mixed")
    assert m.fc.weight.dtype == F32
    out, extra = m(torch.randn(2, 4))
    assert m.seen["autocast"] and m.seen["autocast_dtype"] == BF16 and m.seen["x"] == F32
    assert out.dtype == F32 and extra["half"].dtype == F32  # bf16/fp16 outputs come back as fp32
    assert not torch.is_autocast_enabled("cpu")
    apply_precision(m, "16-mixed")  # re-applying replaces the wrapper, no stacking
    m(torch.randn(2, 4))
    assert m.seen["autocast_dtype"] == F16
    with pytest.raises(RuntimeError):  # an exception in forward leaves autocast too
        m(torch.randn(2, 5))
    assert not torch.is_autocast_enabled("cpu")
    for twin in (copy.deepcopy(m), pickle.loads(pickle.dumps(m))):  # hooks are copyable objects
        twin(torch.randn(2, 4))
        assert twin.seen["autocast_dtype"] == F16 and get_precision(twin) == get_precision(m)
        assert not torch.is_autocast_enabled("cpu")
    remove_precision(m)
    assert get_precision(m) is None and not m._forward_pre_hooks and not m._forward_hooks
    out, _ = m(torch.randn(2, 4))
    assert not m.seen["autocast"] and out.dtype == F32


class GenMLP(ParallelModule):
    """toy_models.MLP written the way generated code is (single process, plan_ngpus 1)."""

    COMPUTE_CONFIG = {"plan_ngpus": 1, "runtime_ngpus": 1}

    def __init__(self, init_params=False):
        super().__init__()
        for i in range(3):
            for kind, shape in (("weight", (16, 16)), ("bias", (16,))):
                self.register_parameter(f"layers_{i}_{kind}", torch.nn.Parameter(torch.empty(shape)))
                self.add_full_map(f"layers_{i}_{kind}", f"layers.{i}.{kind}", shape, tuple((0, d) for d in shape))
        self._post_init(init_params)

    def _forward_impl(self, x, y):
        for i in range(3):
            x = F.gelu(F.linear(x, getattr(self, f"layers_{i}_weight"), getattr(self, f"layers_{i}_bias")))
        return F.mse_loss(x.sum(-1), y)


def gen_mlp():
    pm = GenMLP()
    pm.load_full_state(make_mlp().state_dict())
    return pm


def test_parallel_module_bf16_true_with_build_optimizer_and_clip():
    pm = apply_precision(gen_mlp(), "bf16-true")
    assert all(p.dtype == BF16 for p in pm.parameters())
    opt = with_master_weights(build_optimizer(pm, torch.optim.Adam, lr=LR))
    assert isinstance(opt, torch.optim.Adam) and isinstance(opt, MixedPrecisionOptimizer)
    assert all(p.dtype == F32 for g in opt.param_groups for p in g["params"])
    assert all(id(m) in optimizer_state(opt).replicas for m in opt.master_params)
    pm(**batch(0)).backward()
    want = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad.float()) for p in pm.parameters()]))
    norm = opt.clip_gnorm(1e-3)  # on the fp32 master gradients
    assert torch.allclose(norm, want, rtol=1e-6)
    assert all(m.grad.dtype == F32 for m in opt.master_params)
    clipped = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(m.grad) for m in opt.master_params]))
    assert abs(clipped.item() - 1e-3) < 1e-6
    opt.step()
    assert all(p.dtype == BF16 for p in pm.parameters()) and all(m.grad is None for m in opt.master_params)
    for p in pm.parameters():
        assert torch.equal(p, opt.master_of(p).to(BF16))
    assert opt.state[opt.master_params[0]]["exp_avg"].dtype == F32


# -- bf16 training ------------------------------------------------------------------------------------

def test_bf16_true_matches_fp32_within_bf16_tolerance():
    steps = 10
    ref = make_mlp()
    ref_losses, _ = train(ref, torch.optim.Adam(ref.parameters(), lr=LR), steps)
    for master in (True, False):
        model = apply_precision(make_mlp(), "bf16-true")
        opt = torch.optim.Adam(model.parameters(), lr=LR)
        if master:
            opt = with_master_weights(opt)
        losses, _ = train(model, opt, steps)
        assert all(p.dtype == BF16 for p in model.parameters())
        for step, (got, want) in enumerate(zip(losses, ref_losses)):
            assert abs(got - want) <= BF16_TRUE_LOSS_RTOL * abs(want), (master, step, got, want)
        assert losses != ref_losses  # it really ran in bf16


def test_bf16_mixed_is_the_autocast_computation():
    """Single process: apply_precision('bf16-mixed') runs exactly what torch.autocast runs."""
    ref = make_mlp()
    ref_losses, ref_grads = train(ref, torch.optim.Adam(ref.parameters(), lr=LR), STEPS, autocast=BF16)
    model = apply_precision(make_mlp(), "bf16-mixed")
    opt = with_master_weights(torch.optim.Adam(model.parameters(), lr=LR))
    assert opt.master_params == []  # fp32 weights: nothing to keep a master of
    losses, grads = train(model, opt, STEPS)
    assert losses == ref_losses
    assert all(torch.equal(grads[k], ref_grads[k]) for k in ref_grads)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    fp32 = make_mlp()
    assert abs(fp32(**batch(0)).item() - ref_losses[0]) > STEP0_LOSS_RTOL * abs(ref_losses[0])
