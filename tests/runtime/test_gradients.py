"""loss_reduction / grad_reduction over accumulated micro-batches and data-parallel replicas."""
from __future__ import annotations

import pytest
import torch

import toy_models
from launch import run_workers
from nnscaler.runtime import AggregatedOutputs, ConfigError, grad_scale, reduce_loss
from nnscaler.runtime.gradients import aggregate_outputs, check_reductions

STEPS = 3
LR = 1e-3
TOL = 1e-5
# per rank, the micro-batch sizes of one step (4 micro-batches; uneven for per-token-mean)
MICRO = {"mean": [[1, 1, 1, 1], [1, 1, 1, 1]], "sum": [[1, 1, 1, 1], [1, 1, 1, 1]],
         "per-token-mean": [[2, 1, 1], [1, 1, 2]]}


def test_reduction_arguments_are_checked():
    check_reductions("mean", "per-token-mean", lambda *a: None)
    with pytest.raises(ConfigError, match="optimizer.loss_reduction must be one of mean, sum, got 'avg'"):
        check_reductions("avg", "mean", None)
    with pytest.raises(ConfigError, match="grad_reduction must be one of mean, sum, per-token-mean"):
        check_reductions("mean", "max", None)
    with pytest.raises(ConfigError, match="needs optimizer.aggregate_outputs_fn"):
        check_reductions("mean", "per-token-mean", None)


def test_scale_factors_and_loss():
    agg = AggregatedOutputs(loss_sum=12.0, num_batches=8, num_tokens=32)
    assert grad_scale("mean", agg, dp_size=2) == 2 / 8
    assert grad_scale("sum", agg, dp_size=2) == 2
    assert grad_scale("per-token-mean", agg, dp_size=2) == 2 / 32
    assert reduce_loss(agg, "mean") == 1.5 and reduce_loss(agg, "sum") == 12.0
    with pytest.raises(ConfigError, match="num_tokens"):
        grad_scale("per-token-mean", AggregatedOutputs(1.0, 1), 1)
    agg = aggregate_outputs([torch.tensor(1.0), (torch.tensor(2.0), "extra")])
    assert (agg.loss_sum, agg.num_batches) == (3.0, 2)


def _model(reduction):
    torch.manual_seed(0)
    return toy_models.SumMLP() if reduction == "per-token-mean" else toy_models.MLP()


def reference(reduction):
    model = _model("mean")  # same weights: SumMLP only changes the loss
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        loss = model(**toy_models.mlp_batch(step, 8))
        opt.zero_grad()
        (loss * 8 if reduction == "sum" else loss).backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach() for k, v in model.named_parameters()}


def accumulate(rank, world, gen_dir):
    from nnscaler import ComputeConfig, build_optimizer, parallelize
    from nnscaler.runtime import aggregate_outputs, count_tokens, reduce_gradients, reduce_loss
    out = {}
    for reduction, sizes in MICRO.items():
        cfg = ComputeConfig(1, world, use_end2end=True, trace_strategy="cpu")
        pm = parallelize(_model(reduction), toy_models.mlp_batch(0, 1), "dp", cfg, gen_savedir=gen_dir,
                         instance_name=reduction)
        opt = build_optimizer(pm, torch.optim.Adam, lr=LR)
        losses = []
        for step in range(STEPS):
            full = toy_models.mlp_batch(step, 8)
            start = sum(sum(s) for s in sizes[:rank])
            micro = []
            for n in sizes[rank]:
                micro.append({k: v[start:start + n] for k, v in full.items()})
                start += n
            opt.zero_grad()
            outputs = pm.train_step(micro)
            agg = aggregate_outputs(outputs, pm.grid.sync_group)
            if reduction == "per-token-mean":
                agg.num_tokens = count_tokens(sum(sizes[rank]), pm.grid.sync_group)
                losses.append(agg.loss_sum / agg.num_tokens)
            else:
                losses.append(reduce_loss(agg, "mean"))
            reduce_gradients(opt, reduction, agg, pm.grid.dp_size)
            opt.step()
        out[reduction] = (losses, {rec.full_name: getattr(pm, local).detach().clone()
                                   for local, rec in pm.fullmap.items()})
    return out


@pytest.mark.multiprocess
def test_accumulated_micro_batches_equal_one_big_batch(tmp_path):
    results = run_workers(accumulate, 2, str(tmp_path), timeout=180)
    for reduction in MICRO:
        ref_losses, ref_params = reference(reduction)
        losses, params = results[0][reduction]
        for got, want in zip(losses, ref_losses):
            assert abs(got - want) <= TOL * max(1, abs(want)), (reduction, losses, ref_losses)
        for name, value in params.items():
            assert (value - ref_params[name]).abs().max().item() <= TOL, (reduction, name)
