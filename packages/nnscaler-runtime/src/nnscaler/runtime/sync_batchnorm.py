"""Batch norm whose training-mode statistics span every data-parallel replica (``sync_batchnorm``).

With ``ComputeConfig(sync_batchnorm=True)`` and a data-parallel degree above 1, the generated
code calls ``nr.sync_batchnorm.batch_norm(self, input, running_mean, running_var, weight, bias,
training, momentum, eps)`` where the model calls ``F.batch_norm`` (``nn.BatchNorm1d/2d/3d``).
In eval mode (``training=False``) it is ``F.batch_norm`` itself. In training mode it is
`SyncBatchNormFunction`: the batch mean and variance of each channel are those of the GLOBAL
batch (all replicas of the rank's data-parallel group, `RankGrid.sync_ranks`), so the output,
the gradients and the running statistics are what one process computes on the whole batch:

* forward: each rank computes its local count, mean and sum of squared deviations (M2) per
  channel; ONE all-gather of ``[count, mean, M2]`` (2C+1 numbers per rank) and Chan's parallel
  combination give the global mean and biased variance (numerically like the two-pass variance
  of one process, unlike ``E[x^2] - E[x]^2``). Uneven local batches are exact: every rank's
  count is gathered; a rank with an empty local batch contributes nothing.
* running statistics: ``running_mean = (1 - momentum) * running_mean + momentum * mean`` and
  ``running_var`` likewise with the UNBIASED variance of the global batch (M2 / (N - 1)), the
  same update on every replica, so the replicas stay identical.
* backward: ONE all-reduce of ``[sum(dy), sum(dy * xhat)]`` per channel; the input gradient is
  ``weight * invstd * (dy - sum(dy) / N - xhat * sum(dy * xhat) / N)`` with the global sums, as
  ``torch.nn.SyncBatchNorm``; the weight and bias gradients are the local sums (the data-parallel
  reducer averages them, as every parameter gradient).

Instance norm, group norm and layer norm are per-sample (no statistic spans the batch): they need
no synchronisation and are never rewritten.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch.autograd import Function

from .comm.primitives import all_gather_, all_reduce_, resolve

__all__ = ["batch_norm", "SyncBatchNormFunction"]


def batch_norm(module, input: torch.Tensor, running_mean: Optional[torch.Tensor] = None,
               running_var: Optional[torch.Tensor] = None, weight: Optional[torch.Tensor] = None,
               bias: Optional[torch.Tensor] = None, training: bool = False, momentum: float = 0.1,
               eps: float = 1e-5) -> torch.Tensor:
    """``F.batch_norm`` with the batch statistics of training mode taken over the data-parallel
    replicas of `module` (a ParallelModule: its `grid` names the group). Same arguments as
    ``F.batch_norm``; eval mode and a data-parallel degree of 1 call ``F.batch_norm`` itself."""
    grid = module.grid
    if not training or grid.dp_size == 1:
        return F.batch_norm(input, running_mean, running_var, weight, bias, training, momentum, eps)
    if input.dim() < 2:
        raise ValueError(f"batch_norm expects an input of 2 or more dimensions (N, C, ...), got shape "
                         f"{tuple(input.shape)}")
    rs = resolve(grid.sync_ranks, "sync_batch_norm")
    return SyncBatchNormFunction.apply(input, weight, bias, running_mean, running_var,
                                       float(momentum), float(eps), rs)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class SyncBatchNormFunction(Function):
    """Training-mode batch norm over the ranks of a `RankSet` (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, momentum, eps, rs):
        c = x.shape[1]
        dims = [0] + list(range(2, x.dim()))
        shape = [1, c] + [1] * (x.dim() - 2)
        acc = _acc_dtype(x.dtype)
        xa = x.to(acc)
        n_local = x.numel() // c if c else 0
        if n_local:
            mean_l = xa.mean(dims)
            m2_l = (xa - mean_l.view(shape)).square().sum(dims)
        else:  # an empty local batch: contributes nothing
            mean_l = m2_l = xa.new_zeros(c)
        local = torch.cat([xa.new_full((1,), float(n_local)), mean_l, m2_l])
        stacked = all_gather_(local.unsqueeze(0), 0, rs)  # (ranks, 2C+1)
        counts, means, m2s = stacked[:, :1], stacked[:, 1:c + 1], stacked[:, c + 1:]
        total = float(counts.sum().item())
        if total <= 1:
            raise ValueError(f"Expected more than 1 value per channel when training, got input size "
                             f"{tuple(x.shape)} on this rank and {int(total)} values per channel over the "
                             f"{rs.n} data-parallel replicas (ComputeConfig.sync_batchnorm)")
        mean = (counts * means).sum(0) / total
        m2 = (m2s + counts * (means - mean).square()).sum(0)
        invstd = torch.rsqrt(m2 / total + eps)
        if running_mean is not None:
            running_mean.mul_(1 - momentum).add_((mean * momentum).to(running_mean.dtype))
        if running_var is not None:
            running_var.mul_(1 - momentum).add_((m2 / (total - 1) * momentum).to(running_var.dtype))
        scale = invstd if weight is None else invstd * weight.to(acc)
        shift = -mean * scale if bias is None else bias.to(acc) - mean * scale
        y = (xa * scale.view(shape) + shift.view(shape)).to(x.dtype)
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.total, ctx.rs = total, rs
        return y

    @staticmethod
    def backward(ctx, grad):
        x, weight, mean, invstd = ctx.saved_tensors
        c = x.shape[1]
        dims = [0] + list(range(2, x.dim()))
        shape = [1, c] + [1] * (x.dim() - 2)
        acc = _acc_dtype(x.dtype)
        g = grad.to(acc)
        xhat = (x.to(acc) - mean.view(shape)) * invstd.view(shape)
        sum_dy = g.sum(dims)
        sum_dy_xhat = (g * xhat).sum(dims)
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            total = all_reduce_(torch.cat([sum_dy, sum_dy_xhat]), ctx.rs)
            mean_dy, mean_dy_xhat = total[:c] / ctx.total, total[c:] / ctx.total
            scale = invstd if weight is None else invstd * weight.to(acc)
            grad_input = ((g - mean_dy.view(shape) - xhat * mean_dy_xhat.view(shape))
                          * scale.view(shape)).to(x.dtype)
        if weight is not None and ctx.needs_input_grad[1]:
            grad_weight = sum_dy_xhat.to(weight.dtype)
        if ctx.needs_input_grad[2]:
            grad_bias = sum_dy.to(grad.dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None
