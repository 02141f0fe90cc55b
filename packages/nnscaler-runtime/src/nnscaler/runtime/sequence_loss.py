"""The mean cross-entropy over a sequence split by context parallelism, without gathering the logits.

Under the `cp` policy the logits leave the model split along the sequence; a mean loss
(``F.cross_entropy(..., reduction='mean')``, what transformers' own causal-LM loss computes) cannot
be split by its annotation (a mean of partial means is not the mean), so without this op every rank
would gather the whole (tokens, vocabulary) logits. The generated code calls
``nr.sequence_loss.cross_entropy(input, target, ..., ranks=(...))`` instead: each rank sums the
losses of its own tokens (``reduction='sum'``), one all-reduce adds the sums and the denominators
(the tokens not ignored, or their class weights), and every rank returns the same mean. Backward:
each rank's gradient of its own sum, over the global denominator (the all-reduce's dual is the
identity), so nothing of the vocabulary's size crosses the ranks either way.

Memory: with class indices over ``(tokens, classes)`` logits and no label smoothing (transformers'
loss), each rank's sum is `_SumCrossEntropy`: forward saves the logits themselves (which the model's
output holds anyway) and each token's log-sum-exp, not the log-probabilities, and backward builds the
gradient in one new tensor (``exp(logits - lse) - one_hot``, times the token's weight). So nothing
logits-sized is kept from forward to backward beyond the logits, and the loss holds two logits-sized
tensors at its peak (the logits and their log-probabilities in forward, the logits and their gradient
in backward; a bfloat16 / float16 chunk of rows is upcast to float32 at a time, which keeps the
softmax and the log-sum-exp exact) where ``F.cross_entropy`` holds three (its saved log-probabilities, their gradient and the
logits' gradient, in backward). The logits are the largest activation of a language model (vocabulary
x tokens). Nothing saved is modified, so a second backward through the same graph
(``retain_graph=True``) works.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd import Function
from torch.autograd.function import once_differentiable

from .comm.collectives import all_reduce
from .comm.primitives import CommError, as_ranks

__all__ = ["cross_entropy"]


def cross_entropy(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None, reduction="mean",
                  label_smoothing=0.0, *, ranks) -> torch.Tensor:
    """``F.cross_entropy(reduction='mean')`` over the tokens of every rank in `ranks`, each holding
    its own tokens (input and target split alike). COLLECTIVE over `ranks`: every rank runs one
    all-reduce whatever its tokens (all ignored included)."""
    ranks = as_ranks(ranks)
    if reduction != "mean" or size_average is not None or reduce is not None:
        raise CommError(f"sequence_loss.cross_entropy computes reduction='mean' only (got reduction={reduction!r}, "
                        f"size_average={size_average!r}, reduce={reduce!r}): other reductions split by their "
                        f"annotation")
    total = _sum(input, target, weight, ignore_index, label_smoothing)
    acc = torch.promote_types(total.dtype, torch.float32)  # a bf16 / fp16 count is inexact above 256 tokens
    count = _denominator(input, target, weight, ignore_index).to(acc)
    if len(ranks) == 1:
        return (total.to(acc) / count).to(total.dtype)
    both = all_reduce(torch.stack([total.to(acc), count]), ranks)  # one collective: the sums and the denominators
    return (both[0] / both[1].detach()).to(total.dtype)


def _sum(input, target, weight, ignore_index, label_smoothing) -> torch.Tensor:
    """``F.cross_entropy(reduction='sum')``: `_SumCrossEntropy` where it applies (class indices over
    (tokens, classes), no label smoothing), else torch's."""
    if input.dim() == 2 and not target.is_floating_point() and target.dim() == 1 and label_smoothing == 0.0:
        return _SumCrossEntropy.apply(input, target, weight, ignore_index)
    return F.cross_entropy(input, target, weight=weight, ignore_index=ignore_index, reduction="sum",
                           label_smoothing=label_smoothing)


class _SumCrossEntropy(Function):
    """The summed cross-entropy of (N, C) logits against N class indices; saves the logits, the
    per-token log-sum-exp and weights (see the module docstring)."""

    @staticmethod
    def forward(ctx, input, target, weight, ignore_index):
        acc = torch.promote_types(input.dtype, torch.float32)
        lse = torch.cat([torch.logsumexp(rows.to(acc), dim=1) for rows in _row_chunks(input)])
        keep = target != ignore_index
        t = torch.where(keep, target, 0)
        w = keep.to(acc) if weight is None else torch.where(keep, weight[t].to(acc), 0)
        total = ((lse - input.gather(1, t.unsqueeze(1)).squeeze(1).to(acc)) * w).sum()
        ctx.save_for_backward(input, lse, t, w)
        return total.to(input.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        input, lse, t, w = ctx.saved_tensors
        g = torch.empty_like(input, memory_format=torch.contiguous_format)
        start = 0
        for rows in _row_chunks(input):  # softmax - one_hot, times the weight, in the accumulation dtype
            end = start + rows.shape[0]
            p = torch.sub(rows.to(lse.dtype), lse[start:end].unsqueeze(1)).exp_()
            p[torch.arange(end - start, device=p.device), t[start:end]] -= 1
            g[start:end] = p.mul_((w[start:end] * grad.to(lse.dtype)).unsqueeze(1))
            start = end
        return g, None, None, None


def _row_chunks(x, elements: int = 1 << 24):
    """`x`'s rows in chunks of about `elements` values: a low-precision chunk upcast to float32 stays
    small beside the logits."""
    return x.split(max(1, elements // max(1, x.shape[1])))


def _denominator(input, target, weight, ignore_index) -> torch.Tensor:
    """What ``reduction='mean'`` divides by for these tokens: the targets not ignored (class indices),
    their weights when given; every token for class probabilities."""
    if target.is_floating_point():  # class probabilities: the mean over the tokens
        return torch.tensor(float(input.numel() // input.shape[1 if input.dim() > 1 else 0]), device=input.device)
    keep = target != ignore_index
    if weight is None:
        return keep.sum()
    return torch.where(keep, weight[torch.where(keep, target, 0)], weight.new_zeros(())).sum()
