"""Loss and gradient reduction over micro-batches and data-parallel replicas.

The semantics of the Trainer's `OptimizerConfig` (docs/trainer.md), as functions the Trainer (and a
user's loop) calls after `train_step` ran the micro-batches of one step:

- ``loss_reduction``: ``mean`` — the reported loss is the mean over all micro-batches of all
  replicas; ``sum`` — their sum.
- ``grad_reduction``: ``mean`` — gradients are averaged over all micro-batches of all replicas;
  ``sum`` — summed; ``per-token-mean`` — averaged over all tokens (the loss of a micro-batch must
  then be a *sum* over its tokens, and `aggregate_outputs` must count the tokens).

After backward the data-parallel reducer leaves, on every rank, ``(1/dp) * sum over replicas and
micro-batches of the gradients``; `grad_scale` is the factor that turns it into the requested
reduction, and `reduce_gradients` applies it with ``optimizer.scale_grads``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from .errors import ConfigError, NnScalerError

LOSS_REDUCTIONS = ("mean", "sum")
GRAD_REDUCTIONS = ("mean", "sum", "per-token-mean")


@dataclass
class AggregatedOutputs:
    """What `aggregate_outputs` returns: one step's summed loss and micro-batch (and token) counts."""

    loss_sum: float = None  # the losses of all micro-batches of all replicas, summed
    num_batches: int = None  # micro-batches of all replicas
    num_tokens: Optional[int] = None  # needed by grad_reduction='per-token-mean'
    aggregated_outputs: Any = None  # anything else a custom function wants to pass on


def check_reductions(loss_reduction: str, grad_reduction: str, aggregate_outputs_fn: Optional[Callable]) -> None:
    """Clear errors for the OptimizerConfig fields (names the field and the allowed values)."""
    if loss_reduction not in LOSS_REDUCTIONS:
        raise ConfigError(f"optimizer.loss_reduction must be one of {', '.join(LOSS_REDUCTIONS)}, "
                          f"got {loss_reduction!r}")
    if grad_reduction not in GRAD_REDUCTIONS:
        raise ConfigError(f"optimizer.grad_reduction must be one of {', '.join(GRAD_REDUCTIONS)}, "
                          f"got {grad_reduction!r}")
    if grad_reduction == "per-token-mean" and aggregate_outputs_fn is None:
        raise ConfigError("optimizer.grad_reduction 'per-token-mean' needs optimizer.aggregate_outputs_fn, "
                          "a function returning AggregatedOutputs with num_tokens")


def aggregate_outputs(loss_outputs: Sequence[Any], sync_group=None) -> AggregatedOutputs:
    """The default aggregation: sum the first output (the loss) of every micro-batch over the
    data-parallel replicas of `sync_group` (None: no communication)."""
    losses = [out[0] if isinstance(out, (tuple, list)) else out for out in loss_outputs]
    total = torch.stack([torch.as_tensor(l, dtype=torch.float64).detach().cpu() for l in losses]).sum()
    stats = torch.tensor([float(total), float(len(losses))], dtype=torch.float64)
    if sync_group is not None and dist.is_initialized():
        stats = _all_reduce_cpu(stats, sync_group)
    return AggregatedOutputs(loss_sum=float(stats[0]), num_batches=int(stats[1]))


def count_tokens(num_tokens: int, sync_group=None) -> int:
    """`num_tokens` summed over the replicas of `sync_group` (for per-token-mean)."""
    t = torch.tensor([float(num_tokens)], dtype=torch.float64)
    if sync_group is not None and dist.is_initialized():
        t = _all_reduce_cpu(t, sync_group)
    return int(t.item())


def _all_reduce_cpu(t: torch.Tensor, group) -> torch.Tensor:
    backend = dist.get_backend(group)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    t = t.to(device)
    dist.all_reduce(t, group=group)
    return t.cpu()


def reduce_loss(agg: AggregatedOutputs, loss_reduction: str = "mean") -> float:
    """The step's loss as `loss_reduction` says."""
    check_reductions(loss_reduction, "mean", None)
    return agg.loss_sum / agg.num_batches if loss_reduction == "mean" else agg.loss_sum


def grad_scale(grad_reduction: str, agg: AggregatedOutputs, dp_size: int) -> float:
    """The factor turning the reducer's result into `grad_reduction` (see the module docstring)."""
    if grad_reduction == "mean":
        return dp_size / agg.num_batches
    if grad_reduction == "sum":
        return float(dp_size)
    if grad_reduction == "per-token-mean":
        if not agg.num_tokens:
            raise ConfigError("grad_reduction 'per-token-mean' needs AggregatedOutputs.num_tokens > 0 "
                              "from aggregate_outputs_fn")
        return dp_size / agg.num_tokens
    check_reductions("mean", grad_reduction, None)
    raise AssertionError("unreachable")


def reduce_gradients(optimizer, grad_reduction: str, agg: AggregatedOutputs, dp_size: int) -> float:
    """Scale the gradients held by `optimizer` (built by build_optimizer) as `grad_reduction` says;
    returns the factor used."""
    factor = grad_scale(grad_reduction, agg, dp_size)
    if factor != 1.0:
        optimizer.scale_grads(factor)
    return factor


def scaled_loss(loss: torch.Tensor, scale_fn: Optional[Callable[[torch.Tensor], torch.Tensor]],
                owner: str) -> torch.Tensor:
    """`scale_fn(loss)` (or `loss`), checked to be a tensor backward can run on."""
    if scale_fn is None:
        return loss
    scaled = scale_fn(loss)
    if isinstance(scaled, torch.Tensor) and loss.requires_grad and not scaled.requires_grad:
        raise NnScalerError(f"{owner}.train_step: scale_fn returned a tensor without gradient history; it must "
                            f"compute from the loss it is given (e.g. `lambda loss: loss * 4`), not detach it")
    if not isinstance(scaled, torch.Tensor) or scaled.numel() != 1:
        raise NnScalerError(f"{owner}.train_step: scale_fn must return the scaled loss (a one-element tensor), "
                            f"got {type(scaled).__name__}{'' if not isinstance(scaled, torch.Tensor) else tuple(scaled.shape)}")
    return scaled


def clear_grads(tensors, set_to_none: bool = True) -> None:
    """Clear the gradients of `tensors` as ``torch.optim.Optimizer.zero_grad`` does: drop them
    (``set_to_none``) or zero them in place, detached from any graph."""
    for t in tensors:
        if t.grad is None:
            continue
        if set_to_none:
            t.grad = None
        else:
            if t.grad.grad_fn is not None:
                t.grad.detach_()
            else:
                t.grad.requires_grad_(False)
            t.grad.zero_()
