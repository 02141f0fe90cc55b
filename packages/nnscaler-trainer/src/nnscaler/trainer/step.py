"""One optimizer step and one validation step, with the hooks in the order docs/trainer.md documents.

Train: before_zero_grad, zero_grad, after_zero_grad, on_train_step_start, forward/backward of
every micro-batch (gradients accumulate locally), before_sync_grad, the gradient sync,
after_sync_grad, on_train_step_end, aggregation, after_aggregate_train_step_outputs, gradient
reduction (loss_reduction / grad_reduction), before_gnorm_clip, clip, after_gnorm_clip,
before_optimizer_step, step, after_optimizer_step.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

import torch
from nnscaler.runtime import (ParallelModule, aggregate_outputs, reduce_gradients, reduce_loss,
                              sync_grad_when)

__all__ = ["train_step", "val_step", "sync_group_of", "aggregate"]


def _parallel_modules(model: torch.nn.Module):
    return [m for m in model.modules() if isinstance(m, ParallelModule)]


def sync_group_of(model: torch.nn.Module):
    """The process group over the data-parallel replicas of this rank's shard (None with one)."""
    pms = _parallel_modules(model)
    grid = pms[0].grid
    return grid.sync_group if grid.dp_size > 1 else None


def aggregate(trainer, outputs: List[Any]):
    """AggregatedOutputs of the micro-batch outputs over the data-parallel replicas."""
    fn = trainer.aggregate_outputs_fn or aggregate_outputs
    if not outputs and fn is aggregate_outputs:  # a rank with only padding validation batches
        return _aggregate_nothing(sync_group_of(trainer.model))
    return fn(outputs, sync_group_of(trainer.model))


def _aggregate_nothing(group):
    """What `aggregate_outputs` returns, this rank adding no batch (it joins the same all-reduce
    of [loss_sum, num_batches] in float64 the other replicas run)."""
    import torch.distributed as dist
    from nnscaler.runtime import AggregatedOutputs
    stats = torch.zeros(2, dtype=torch.float64)
    if group is not None and dist.is_initialized():
        if dist.get_backend(group) == "nccl":
            stats = stats.to(torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(stats, group=group)
        stats = stats.cpu()
    return AggregatedOutputs(loss_sum=float(stats[0]), num_batches=int(stats[1]))


def _is_pipelined(model: torch.nn.Module) -> bool:
    return any(pm.PIPELINE is not None for pm in _parallel_modules(model))


def _forward_backward(trainer, batches: List[Any], scale_fn: Optional[Callable]) -> List[Any]:
    """Every micro-batch; gradients synced in the last backward unless sync is paused around."""
    model = trainer.model
    if isinstance(model, ParallelModule):
        return model.train_step([(b,) for b in batches], scale_fn=scale_fn)  # forward(batch)
    outputs = []  # a plain model with parallelized sub-modules (model.parallel_modules)
    for i, batch in enumerate(batches):
        with sync_grad_when(i == len(batches) - 1):
            out = model(batch)
            loss = out[0] if isinstance(out, (tuple, list)) else out
            (scale_fn(loss) if scale_fn is not None else loss).backward()
        outputs.append(_detach(out))
    return outputs


def _detach(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return out.detach()
    if isinstance(out, (tuple, list)):
        return type(out)(_detach(o) for o in out)
    if isinstance(out, dict):
        return {k: _detach(v) for k, v in out.items()}
    return out


def _scale_fn(factor: Optional[float], precision) -> Optional[Callable]:
    scaler = precision.scale_loss if precision.scaler is not None else None
    if factor is None or factor == 1.0:
        return scaler
    if scaler is None:
        return lambda loss: loss * factor
    return lambda loss: scaler(loss * factor)


def train_step(trainer, batches: List[Any]) -> Tuple[List[Any], Any, float, Optional[float]]:
    """Returns (outputs, aggregated outputs, reduced loss, gradient norm)."""
    hooks, optimizer, precision = trainer.hooks, trainer.optimizer, trainer.precision
    opt_cfg = trainer.train_args.optimizer
    with hooks.around("zero_grad", trainer):
        optimizer.zero_grad()
    hooks.on_train_step_start(trainer, batches)
    # mean / sum: the factor is known before backward (1 / micro-batches per rank, or dp), so it
    # scales each loss instead of costing a pass over the gradients afterwards
    factor = {"mean": 1.0 / len(batches), "sum": float(trainer.train_args.dp_size)}.get(opt_cfg.grad_reduction)
    outputs = _forward_backward_sync(trainer, batches, _scale_fn(factor, precision))
    hooks.on_train_step_end(trainer, outputs)
    agg = aggregate(trainer, outputs)
    loss = reduce_loss(agg, opt_cfg.loss_reduction)
    hooks.after_aggregate_train_step_outputs(trainer, agg, loss)
    if factor is None:  # per-token-mean: known only after aggregation
        reduce_gradients(optimizer, opt_cfg.grad_reduction, agg, trainer.train_args.dp_size)
    hooks.before_gnorm_clip(trainer)
    gnorm = precision.clip_gnorm(optimizer, opt_cfg.clip_gnorm or None)
    hooks.after_gnorm_clip(trainer, gnorm)
    with hooks.around("optimizer_step", trainer):
        precision.step(optimizer)
    return outputs, agg, loss, float(gnorm) if gnorm is not None else None


def _forward_backward_sync(trainer, batches: List[Any], scale_fn: Optional[Callable]) -> List[Any]:
    """Every micro-batch and the gradient sync, with before_sync_grad / after_sync_grad."""
    hooks = trainer.hooks
    if hooks.defines("before_sync_grad") and not _is_pipelined(trainer.model):
        with sync_grad_when(False):  # accumulate locally, so the hook runs before the sync
            outputs = _forward_backward(trainer, batches, scale_fn)
        hooks.before_sync_grad(trainer)
        trainer.optimizer.sync_grads()  # build_optimizer's: every reducer of the model
    else:
        if _is_pipelined(trainer.model):  # the executor syncs inside train_step
            hooks.before_sync_grad(trainer)
        outputs = _forward_backward(trainer, batches, scale_fn)
    hooks.after_sync_grad(trainer)
    return outputs


def val_step(trainer, batches: List[Any]) -> List[Any]:
    """Forward without gradients; returns the outputs."""
    trainer.hooks.on_val_step_start(trainer, batches)
    model = trainer.model
    if isinstance(model, ParallelModule):
        outputs = model.infer_step([(b,) for b in batches])
    else:
        with torch.no_grad():
            outputs = [model(b) for b in batches]
    outputs = [_detach(o) for o in outputs]
    trainer.hooks.on_val_step_end(trainer, outputs)
    return outputs
