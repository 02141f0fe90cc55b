"""Precision in training: fp32 master weights, fp16 on CPU and the grad scaler, and bf16 on 2
data-parallel gloo ranks against one process under torch.autocast.

Parsing, casts and autocast: test_precision.py (helpers and shared constants imported from it).

Tolerances (bf16 keeps 8 significant bits: unit roundoff u = 2**-8 ~= 3.9e-3; fp16 keeps 11:
u = 2**-11 ~= 4.9e-4):

- bf16-mixed, 2 data-parallel ranks vs one process under torch.autocast (same weights, batches):
  * step-0 loss: STEP0_LOSS_RTOL = 1e-5. Before any update the forward is the same bf16
    computation row by row; only the fp32 mean over the batch is summed in another order
    (measured: 0.0). A run in fp32 instead of bf16 differs by ~6e-4, so this proves autocast ran.
    (bf16-true with fp32 master weights, also checked: its loss is a bf16 number, rounded on each
    rank and in the reference, so BF16_LOSS_ULP = 2u = 2**-7; the other tolerances are the same.)
  * first gradients: GRAD_RTOL = 1e-2 (relative L2, ~2.5u). Autocast rounds each weight
    gradient to bf16 before it is upcast to the fp32 weight; with 2 ranks each half-batch sum is
    rounded, then averaged in fp32, so elements differ by O(u) (measured 2.5e-3).
  * losses of every step: LOSS_RTOL = 1e-2 (~2.5u) (measured <= 1.1e-3).
  * parameters after STEPS Adam steps: the difference relative to the reference update,
    ||p - p_ref|| / ||p_ref - p_init|| <= UPDATE_RTOL = 0.1, and every element within
    2 * LR * STEPS. Adam's step m / sqrt(v) does not shrink relative gradient errors: an element
    whose gradient is as small as the O(u) rounding noise can move by up to +-LR per step either
    way (hence the element bound), while the update as a whole agrees closely: measured 2-3%,
    vs ~85% for ranks that skip the gradient all-reduce.
- FP16_MIXED_LOSS_RTOL = 5e-3 (~10u of fp16), fp16 runs with the grad scaler vs fp32.
"""
from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
import torch.nn.functional as F

from launch import run_workers
from nnscaler.runtime.optimizer import build_optimizer
from nnscaler.runtime.precision import (GradScaler, MixedPrecisionOptimizer, PrecisionConfig, PrecisionPlugin,
                                        apply_precision, with_master_weights)
from test_precision import BF16, F16, F32, LR, N, STEP0_LOSS_RTOL, STEPS, batch, make_mlp, train
from nnscaler.runtime.optimizer_state import optimizer_state


BF16_LOSS_ULP = 2.0 ** -7  # 2u: bf16-true losses are bf16 numbers
GRAD_RTOL = 1e-2
LOSS_RTOL = 1e-2
UPDATE_RTOL = 0.1
FP16_MIXED_LOSS_RTOL = 5e-3  # ~10u of fp16; measured <= 1.3e-3 (16-mixed), 7.5e-4 (16-true + masters)


def params_of(model):
    return {k: p.detach().float().clone() for k, p in model.named_parameters()}


def rel_l2(got, want):
    num = sum(((got[k].double() - want[k].double()) ** 2).sum() for k in want) ** 0.5
    den = sum((want[k].double() ** 2).sum() for k in want) ** 0.5
    return (num / den).item()


# -- master weights -----------------------------------------------------------------------------------

def test_master_weights_keep_small_updates():
    """bf16 has 8 significant bits: 1.0 - 1e-3 rounds back to 1.0, so plain bf16 SGD never
    moves; the fp32 master accumulates the updates and the bf16 copy follows."""
    plain = torch.nn.Parameter(torch.ones(4, dtype=BF16))
    kept = torch.nn.Parameter(torch.ones(4, dtype=BF16))
    opt_plain = torch.optim.SGD([plain], lr=1e-3)
    opt_kept = with_master_weights(torch.optim.SGD([kept], lr=1e-3))
    for _ in range(10):
        for p, opt in ((plain, opt_plain), (kept, opt_kept)):
            opt.zero_grad()
            p.grad = torch.ones(4, dtype=BF16)
            opt.step()
    assert torch.equal(plain, torch.ones(4, dtype=BF16))
    assert torch.allclose(opt_kept.master_of(kept), torch.full((4,), 0.99), atol=1e-6)
    assert torch.equal(kept, torch.full((4,), 0.99).to(BF16)) and kept.dtype == BF16


def test_master_weights_fix_fp16_adam():
    """Pure fp16 Adam divides by sqrt(v) + eps with eps = 1e-8 -> 0 in fp16: a zero gradient
    gives NaN, a tiny one -inf. With fp32 masters the state is fp32 and the step is sane."""
    grads = torch.tensor([0.0, 1e-4, 1.0], dtype=F16)
    plain = torch.nn.Parameter(torch.ones(3, dtype=F16))
    plain.grad = grads.clone()
    torch.optim.Adam([plain], lr=1e-3).step()
    assert plain.isnan()[0] and plain.isinf()[1]
    kept = torch.nn.Parameter(torch.ones(3, dtype=F16))
    opt = with_master_weights(torch.optim.Adam([kept], lr=1e-3))
    kept.grad = grads.clone()
    opt.step()
    assert torch.isfinite(kept).all() and opt.state[opt.master_of(kept)]["exp_avg_sq"].dtype == F32
    assert torch.allclose(kept.float(), torch.tensor([1.0, 0.999, 0.999]), atol=1e-3)


def test_master_weights_state_dtypes_schedulers_and_state_dict():
    model = apply_precision(make_mlp(), "bf16-true")
    base = torch.optim.Adam(model.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(base, lambda step: 0.5 ** step)  # created before the masters
    opt = with_master_weights(base)
    assert opt is base and with_master_weights(opt) is opt
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()" warning
        train(model, opt, 2)
        sched.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == LR * 0.25
    assert all(p.dtype == BF16 for p in model.parameters())
    for m in opt.master_params:
        assert m.dtype == F32 and opt.state[m]["exp_avg"].dtype == F32 and opt.state[m]["exp_avg_sq"].dtype == F32
    saved_opt = copy.deepcopy(opt.state_dict())
    saved_model = copy.deepcopy(model.state_dict())
    assert saved_opt["state"][0]["exp_avg"].dtype == F32
    assert set(saved_opt["master_weights"]) == set(range(6)) and saved_opt["master_weights"][0].dtype == F32
    masters = [m.clone() for m in opt.master_params]
    assert any(not torch.equal(m, m.to(BF16).float()) for m in masters)  # the masters hold more bits

    def more(model, opt):
        for s in range(2, 4):
            opt.zero_grad()
            model(**batch(s)).backward()
            opt.step()
        return params_of(model), [m.clone() for m in opt.master_params]

    want = more(model, opt)
    model2 = apply_precision(make_mlp(), "bf16-true")
    model2.load_state_dict(saved_model)
    opt2 = with_master_weights(torch.optim.Adam(model2.parameters(), lr=LR))
    opt2.load_state_dict(saved_opt)
    assert all(torch.equal(a, b) for a, b in zip(opt2.master_params, masters))
    assert opt2.param_groups[0]["lr"] == LR * 0.25
    got = more(model2, opt2)
    assert all(torch.equal(got[0][k], want[0][k]) for k in want[0])
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
    # a state dict without masters: masters start from the (bf16) parameters
    opt3 = with_master_weights(torch.optim.Adam(model2.parameters(), lr=LR))
    plain = {k: v for k, v in saved_opt.items() if k != "master_weights"}
    opt3.load_state_dict(plain)
    assert all(torch.equal(m, p.float()) for (p, m) in optimizer_state(opt3).masters.pairs)


def test_master_weights_zero_grad_and_closure():
    model = apply_precision(make_mlp(), "bf16-true")
    opt = with_master_weights(torch.optim.SGD(model.parameters(), lr=0.1))
    model(**batch(0)).backward()
    opt.prepare_master_grads()
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    assert all(m.grad is None for m in opt.master_params)

    def closure():
        opt.zero_grad()
        loss = model(**batch(0))
        loss.backward()
        return loss

    before = params_of(model)
    assert opt.step(closure).dtype == BF16
    assert any(not torch.equal(before[k], v) for k, v in params_of(model).items())


# -- fp16 on CPU and the grad scaler ------------------------------------------------------------------

@pytest.mark.parametrize("op", [
    lambda x: F.gelu(F.linear(x, torch.randn(8, 8, dtype=F16))),
    lambda x: F.layer_norm(x, (8,)),
    lambda x: F.softmax(x, -1),
    lambda x: F.scaled_dot_product_attention(x[None, None], x[None, None], x[None, None]),
    lambda x: F.conv1d(x[None], torch.randn(2, 4, 3, dtype=F16)),
    lambda x: F.cross_entropy(x, torch.arange(4)),
    lambda x: torch.cumsum(x, -1),
], ids=["linear_gelu", "layer_norm", "softmax", "sdpa", "conv1d", "cross_entropy", "cumsum"])
def test_fp16_ops_run_on_cpu(op):
    """torch 2.13 has CPU fp16 kernels (forward and backward) for the usual training ops."""
    x = torch.randn(4, 8, dtype=F16, requires_grad=True)
    out = op(x)
    assert out.dtype == F16
    out.float().sum().backward()
    assert x.grad.dtype == F16 and torch.isfinite(x.grad).all()


def test_fp16_mixed_with_grad_scaler_matches_fp32():
    steps = 5
    ref = make_mlp()
    ref_losses, _ = train(ref, torch.optim.Adam(ref.parameters(), lr=LR), steps)
    plugin = PrecisionPlugin("16-mixed", device="cpu")
    assert isinstance(plugin.scaler, GradScaler)
    model = plugin.setup_module(make_mlp())
    opt = plugin.setup_optimizer(torch.optim.Adam(model.parameters(), lr=LR))
    assert not isinstance(opt, MixedPrecisionOptimizer)  # fp32 weights in mixed mode
    losses = []
    for s in range(steps):
        opt.zero_grad()
        loss = model(**batch(s))
        plugin.backward(loss)
        assert plugin.step(opt)
        losses.append(loss.item())
    for got, want in zip(losses, ref_losses):
        assert abs(got - want) <= FP16_MIXED_LOSS_RTOL * abs(want)
    assert losses != ref_losses


def test_fp16_true_with_scaler_and_master_weights():
    ref = make_mlp()
    ref_losses, _ = train(ref, torch.optim.Adam(ref.parameters(), lr=LR), 5)
    # the default initial scale 2**16 overflows this model's fp16 gradients: the scaler skips the
    # first step and backs off; 2**10 fits and every step is taken
    for init_scale, want_stepped in ((2.0 ** 16, [False, True, True, True, True]), (2.0 ** 10, [True] * 5)):
        plugin = PrecisionPlugin("16-true", grad_scaler=GradScaler("cpu", init_scale=init_scale), device="cpu")
        model = plugin.setup_module(make_mlp())
        opt = plugin.setup_optimizer(torch.optim.Adam(model.parameters(), lr=LR))  # masters: fp16 params
        assert isinstance(opt, MixedPrecisionOptimizer) and all(p.dtype == F16 for p in model.parameters())
        stepped, losses = [], []
        for s in range(5):
            opt.zero_grad()
            loss = model(**batch(s))  # the input hook casts the fp32 batch to fp16
            assert loss.dtype == F16
            plugin.backward(loss)
            stepped.append(plugin.step(opt))
            losses.append(loss.item())
        assert stepped == want_stepped and all(torch.isfinite(p).all() for p in model.parameters())
    assert plugin.scaler.get_scale() == 2.0 ** 10
    for got, want in zip(losses, ref_losses):
        assert abs(got - want) <= FP16_MIXED_LOSS_RTOL * abs(want), (losses, ref_losses)
    # without masters the scaler unscales the fp16 gradients themselves (torch's refuses to)
    model = plugin.setup_module(make_mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu")
    scaler.scale(model(**batch(0))).backward()
    scaler.unscale_(opt)
    assert all(p.grad.dtype == F16 for p in model.parameters())


@pytest.mark.parametrize("fused", [False, True])
def test_grad_scaler_skips_inf_steps_and_recovers(fused):
    model = apply_precision(make_mlp(), "bf16-true")
    # a fused Adam would let GradScaler hand it the scale instead of unscaling (never seeing the
    # masters' gradients): with_master_weights turns that path off
    opt = with_master_weights(torch.optim.Adam(model.parameters(), lr=LR, fused=fused))
    scaler = GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1)
    before = params_of(model)
    scaler.scale(model(**batch(0))).backward()
    model.layers[1].weight.grad[0, 0] = float("inf")
    scaler.step(opt)
    scaler.update()
    assert scaler.last_step_skipped and scaler.skipped_steps == 1
    assert scaler.get_scale() == 2.0 ** 9  # backed off
    assert all(torch.equal(before[k], v) for k, v in params_of(model).items())
    assert opt.state == {} or all(len(s) == 0 for s in opt.state.values())  # Adam never stepped
    assert all(m.grad is None for m in opt.master_params)  # released by update()
    opt.zero_grad()
    scaler.scale(model(**batch(0))).backward()
    scaler.step(opt)
    scaler.update()
    assert not scaler.last_step_skipped and scaler.get_scale() == 2.0 ** 10  # grew (growth_interval=1)
    assert any(not torch.equal(before[k], v) for k, v in params_of(model).items())
    assert int(opt.state[opt.master_params[0]]["step"]) == 1
    state = scaler.state_dict()
    other = GradScaler("cpu")
    other.load_state_dict(state)
    assert other.state_dict() == state and other.get_scale() == 2.0 ** 10
    assert pickle.loads(pickle.dumps(scaler)).get_scale() == 2.0 ** 10


def test_grad_scaler_nan_loss_skips():
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plugin = PrecisionPlugin(PrecisionConfig(grad_scaler=True), device="cpu")
    before = params_of(model)
    plugin.backward(model(**batch(0)) * float("nan"))
    assert plugin.step(opt) is False
    assert all(torch.equal(before[k], v) for k, v in params_of(model).items())
    assert plugin.state_dict()["scaler"]["scale"] == 2.0 ** 15


def test_unscale_happens_before_clipping():
    """The plugin unscales before it clips (once per step); the norm is the true gradient norm."""
    ref = make_mlp()
    ref(**batch(0)).backward()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), float("inf"))
    for master in (False, True):
        model = make_mlp()
        if master:
            apply_precision(model, "bf16-true")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        plugin = PrecisionPlugin(PrecisionConfig(grad_scaler=True), master_weights=master, device="cpu")
        opt = plugin.setup_optimizer(opt)
        plugin.backward(model(**batch(0)))
        norm = plugin.clip_gnorm(opt, 0.5)
        rtol = 1e-6 if not master else GRAD_RTOL
        assert abs(norm.item() - want.item()) <= rtol * want.item(), (master, norm, want)
        plugin.clip_gnorm(opt)  # a second call must not unscale again
        assert plugin.step(opt)


def test_torch_grad_scaler_with_masters_fails_loudly():
    """torch's own GradScaler does not know about the masters: it finds no gradients to check
    and refuses to step instead of stepping on scaled gradients."""
    model = apply_precision(make_mlp(), "bf16-true")
    opt = with_master_weights(torch.optim.SGD(model.parameters(), lr=0.1))
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(model(**batch(0))).backward()
    with pytest.raises(AssertionError, match="No inf checks were recorded"):
        scaler.step(opt)


# -- data parallel on 2 gloo ranks --------------------------------------------------------------------

def reference_runs():
    fp32 = make_mlp()
    init = params_of(fp32)
    fp32_loss0 = fp32(**batch(0)).item()
    out = {"init": init, "fp32_loss0": fp32_loss0}
    model = make_mlp()
    out["bf16-mixed"] = (*train(model, torch.optim.Adam(model.parameters(), lr=LR), STEPS, autocast=BF16),
                         params_of(model))
    model = apply_precision(make_mlp(), "bf16-true")
    opt = with_master_weights(torch.optim.Adam(model.parameters(), lr=LR))
    out["bf16-true"] = (*train(model, opt, STEPS), params_of(model))
    return out


def dp_worker(rank, world, gen_dir):
    import torch.distributed as dist
    from nnscaler import ComputeConfig, parallelize

    per = N // world
    results = {}
    for mode in ("bf16-mixed", "bf16-true"):
        pm = parallelize(make_mlp(), batch(0, per), "dp", ComputeConfig(1, world, trace_strategy="cpu"),
                         gen_savedir=gen_dir, instance_name=mode.replace("-", "_"))
        apply_precision(pm, mode)
        opt = with_master_weights(build_optimizer(pm, torch.optim.Adam, lr=LR))
        losses, first = [], None
        for step in range(STEPS):
            full = batch(step)
            mine = {k: v[rank * per:(rank + 1) * per] for k, v in full.items()}
            opt.zero_grad()
            loss = pm(**mine)
            loss.backward()
            if step == 0:
                first = {pm.fullmap[n].full_name: p.grad.float().clone() for n, p in pm.named_parameters()}
            opt.step()
            t = loss.detach().float().reshape(1).clone()
            dist.all_reduce(t)
            losses.append(t.item() / world)
        params = {pm.fullmap[n].full_name: p.detach().float().clone() for n, p in pm.named_parameters()}
        dtypes = {"param": {p.dtype for p in pm.parameters()},
                  "state": {v.dtype for s in opt.state.values() for k, v in s.items() if k != "step"}}
        # the inf/nan flag is agreed over the ranks: only rank 1 sees an inf, both skip
        scaler = GradScaler("cpu")
        opt.zero_grad()
        scaler.scale(pm(**batch(0, per))).backward()
        if rank == 1:
            next(pm.parameters()).grad.view(-1)[0] = float("inf")
        before = [p.detach().clone() for p in pm.parameters()]
        scaler.step(opt)
        scaler.update()
        skipped = (scaler.last_step_skipped, scaler.get_scale(),
                   all(torch.equal(a, b) for a, b in zip(before, pm.parameters())))
        results[mode] = (losses, first, params, dtypes, skipped)
    return results


@pytest.mark.multiprocess
def test_dp_bf16_matches_single_process_autocast(tmp_path):
    ref = reference_runs()
    results = run_workers(dp_worker, 2, str(tmp_path / "gen"), timeout=240)
    for mode, want_param_dtype in (("bf16-mixed", F32), ("bf16-true", BF16)):
        ref_losses, ref_first, ref_params = ref[mode]
        losses, first, params, dtypes, _ = results[0][mode]
        assert dtypes == {"param": {want_param_dtype}, "state": {F32}}, mode
        # step 0: the same bf16 forward (a run in fp32 would be ~6e-4 off); a bf16-true loss is
        # itself a bf16 number (each rank's and the reference's rounded: within 2u)
        tol = STEP0_LOSS_RTOL if mode == "bf16-mixed" else BF16_LOSS_ULP
        assert abs(losses[0] - ref_losses[0]) <= tol * abs(ref_losses[0]), (mode, losses, ref_losses)
        if mode == "bf16-mixed":
            assert abs(ref["fp32_loss0"] - ref_losses[0]) > STEP0_LOSS_RTOL * abs(ref_losses[0])
        assert rel_l2(first, ref_first) <= GRAD_RTOL, (mode, rel_l2(first, ref_first))
        for step, (got, want) in enumerate(zip(losses, ref_losses)):
            assert abs(got - want) <= LOSS_RTOL * abs(want), (mode, step, got, want)
        got_update = {k: params[k] - ref["init"][k] for k in ref_params}
        want_update = {k: ref_params[k] - ref["init"][k] for k in ref_params}
        assert rel_l2(got_update, want_update) <= UPDATE_RTOL, (mode, rel_l2(got_update, want_update))
        assert max((params[k] - ref_params[k]).abs().max().item() for k in ref_params) <= 2 * LR * STEPS, mode
        # replicas agree exactly; every rank skipped the step where only rank 1 saw an inf
        for k, v in results[1][mode][2].items():
            assert torch.equal(v, params[k]), (mode, k)
        for r in range(2):
            assert results[r][mode][4] == (True, 2.0 ** 15, True), (mode, r, results[r][mode][4])
