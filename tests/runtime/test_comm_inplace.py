"""In-place ops after every collective of nnscaler.runtime.comm, forward and backward (issue 11).

Autograd refuses an in-place op on a custom Function's output that is a view ("Output 0 of
_AllToAll is a view and is being modified inplace"), and an output sharing memory with the input
would let the in-place op corrupt the input. Every collective (native and fallback) is followed
by ``mul_``/``add_``/``relu_`` on 2 gloo ranks: the output and the input's gradient equal the
single-process computation (the table of `test_comm._expected`), the outputs and the backward's
results are not views, the input is unchanged; `grad_all_reduce` of a parameter, or of any weight
passed with ``weight=True`` (ZeRO-3's gathered tensors), is the weight's view (no copy) and its
gradient the all-reduced one. The ResNet-18-style model with
``ReLU(inplace=True)`` runs under `tp` 2 in eval and training mode (and traced in eval, then
trained) and matches one process.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from launch import run_workers
import nnscaler.runtime.comm as comm
from resnet_models import ResNet, resnet_batch64, train_reference
from test_comm import _expected, _full


OFFSET = 1000.0  # y * 2 + OFFSET > 0: the relu_ after it passes every gradient


def _cases(k, x, g):
    """name -> (function, kwargs, local input, local output gradient), as test_comm's job."""
    xt = _full(2, (6, 4)).t()
    return {
        "split": ("split", dict(dim=1), x, g.chunk(2, 1)[k]),
        "split_nc": ("split", dict(dim=0), xt, g.chunk(2, 0)[k]),
        "all_gather": ("all_gather", dict(dim=0), x.chunk(2, 0)[k], g),
        "all_gather_nc": ("all_gather", dict(dim=-1), xt[:, 3 * k:3 * k + 3], g),
        "all_reduce": ("all_reduce", {}, x * (k + 1), g),
        "reduce_scatter": ("reduce_scatter", dict(dim=1), x * (k + 1), g.chunk(2, 1)[k]),
        "all_to_all": ("all_to_all", dict(src_dim=0, dst_dim=1), x.chunk(2, 0)[k], g.chunk(2, 1)[k]),
        "to_partial": ("to_partial", {}, x, g),
        "shard_to_partial": ("shard_to_partial", dict(dim=1), x.chunk(2, 1)[k], g),
        "grad_all_reduce": ("grad_all_reduce", {}, x, g * (k + 1)),
        "all_gather_rs": ("all_gather_rs", dict(dim=1), x.chunk(2, 1)[k], g * (k + 1)),
        "all_reduce_ar": ("all_reduce_ar", {}, x * (k + 1), g * (k + 1)),
    }


def _inplace_job(rank, world):
    ranks, k = (0, 1), rank
    x, g = _full(0), _full(1)
    out = {}
    for forced in (False, True):
        with comm.force_fallback() if forced else contextlib.nullcontext():
            for case, (fn, kwargs, xl, gl) in _cases(k, x, g).items():
                leaf = xl.detach().clone().requires_grad_()
                before = leaf.detach().clone()
                src = leaf * 1.0  # a non-leaf input, as in a real forward
                y = getattr(comm, fn)(src, **kwargs, ranks=ranks)
                is_view = y._is_view()
                y.mul_(2).add_(OFFSET).relu_()  # refused by autograd if y were a view
                src_intact = torch.equal(src.detach(), before)
                (gx,) = torch.autograd.grad(y, leaf, gl)
                # the backward of the collective alone: its result is not a view either
                probe = src.detach().requires_grad_()
                z = getattr(comm, fn)(probe, **kwargs, ranks=ranks)
                (gz,) = torch.autograd.grad(z, probe, gl.clone())
                # relu_ right after the collective, masking (forward values)
                r = getattr(comm, fn)(leaf * 1.0, **kwargs, ranks=ranks)
                r.relu_()
                out[forced, case] = (y.detach(), gx, is_view, src_intact, gz._is_view(), r.detach())
        # a parameter (a replicated weight): a view of itself, no copy; its gradient all-reduced
        p = torch.nn.Parameter(x.clone())
        w = comm.grad_all_reduce(p, ranks=ranks)
        (w * g * (k + 1)).sum().backward()
        out[forced, "parameter"] = (w.untyped_storage().data_ptr() == p.untyped_storage().data_ptr(), p.grad)
        # a weight that is no parameter (ZeRO-3's gathered tensor: a function's output), weight=True
        leaf = x.clone().requires_grad_(True)
        gathered = leaf * 1.0
        w = comm.grad_all_reduce(gathered, ranks=ranks, weight=True)
        (w * g * (k + 1)).sum().backward()
        out[forced, "weight"] = (w.untyped_storage().data_ptr() == gathered.untyped_storage().data_ptr(), leaf.grad)
    return out


@pytest.mark.multiprocess
def test_every_collective_allows_inplace_ops_forward_and_backward():
    results = run_workers(_inplace_job, 2, timeout=120)
    x, g = _full(0), _full(1)
    for k, res in enumerate(results):
        for forced in (False, True):
            for case in _cases(k, x, g):
                where = f"{'fallback' if forced else 'native'} {case} rank {k}"
                y, gx, is_view, src_intact, gz_view, r = res[forced, case]
                want_y, want_grad, _ = _expected(case, k, x, g)
                assert not is_view, f"{where}: the output is a view"
                assert src_intact, f"{where}: the in-place op changed the collective's input"
                torch.testing.assert_close(y, want_y * 2 + OFFSET, msg=where)
                torch.testing.assert_close(gx, want_grad * 2, msg=where)  # d(2y)/dy = 2
                torch.testing.assert_close(r, want_y.relu(), msg=where)
                identity_backward = case in ("all_reduce", "to_partial")  # passes the grad on
                assert identity_backward or not gz_view, f"{where}: the backward's result is a view"
            for case in ("parameter", "weight"):
                shares, pgrad = res[forced, case]
                assert shares, f"grad_all_reduce copied a {case} (a view of it saves a copy a step)"
                torch.testing.assert_close(pgrad, g * 3)  # ranks' partial gradients g and 2g, summed


# -- a ResNet-18-style model with ReLU(inplace=True) under tp 2 -------------------------------------
STEPS = 3
BATCH = 8
LR = 1e-2
TOL = 1e-10  # float64: the plan computes what one process computes, up to summation order
# (mode traced in, mode run in): a module traced in eval mode may train; its batch norm must not
# have been split along the batch then
MODES = [(False, False), (True, True), (False, True)]


def _batch(step):
    return resnet_batch64(step, BATCH)


def _resnet_reference(training):
    return train_reference(STEPS, BATCH, lambda ps: torch.optim.SGD(ps, lr=LR), training)


def _resnet_job(rank, world, gen_dir):
    import warnings
    from nnscaler import ComputeConfig, build_optimizer, parallelize
    out = {}
    for traced, training in MODES:
        torch.manual_seed(0)
        model = ResNet().double().train(traced)
        cfg = ComputeConfig(2, 2, trace_strategy="cpu")
        with warnings.catch_warnings():  # the plan report: tp leaves many conv weights replicated
            warnings.simplefilter("ignore")
            pm = parallelize(model, _batch(0), "tp", cfg, gen_savedir=gen_dir,
                             instance_name=f"resnet_{traced}_{training}")
        pm.train(training)
        opt = build_optimizer(pm, torch.optim.SGD, lr=LR)
        losses = []
        for step in range(STEPS):
            loss = pm(**_batch(step))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        shards = [(e.full_name, e.full_shape, e.slices, getattr(pm, local).detach().clone())
                  for local, e in pm.fullmap.items() if torch.is_tensor(getattr(pm, local))]
        out[traced, training] = (losses, shards)
    return out


def merge_shards(per_rank):
    """Full float64 tensors from every rank's (full name, full shape, slices, value) list."""
    full = {}
    for shards in per_rank:
        for name, shape, slices, value in shards:
            t = full.setdefault(name, torch.full(shape, float("nan"), dtype=torch.float64))
            t[tuple(slice(a, b) for a, b in slices)] = value.double()
    return full


@pytest.mark.multiprocess
@pytest.mark.slow
def test_resnet_with_inplace_relu_under_tp_matches_one_process(tmp_path):
    results = run_workers(_resnet_job, 2, str(tmp_path / "gen"), timeout=400)
    for traced, training in MODES:
        ref_losses, ref_state = _resnet_reference(training)
        merged = merge_shards([res[traced, training][1] for res in results])
        for step, (got, want) in enumerate(zip(results[0][traced, training][0], ref_losses)):
            assert abs(got - want) <= TOL * max(1.0, abs(want)), (training, step, got, want)
        assert set(merged) == set(ref_state), set(merged) ^ set(ref_state)
        for name, want in ref_state.items():
            got, want = merged[name], want.double()
            assert not torch.isnan(got).any(), f"{name}: parts are held by no rank"
            rel = ((got - want).norm() / want.norm().clamp_min(1e-12)).item()
            assert rel <= TOL, f"traced training={traced}, run training={training}: {name} differs (relative {rel:.2e})"
