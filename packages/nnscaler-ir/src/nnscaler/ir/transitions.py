"""Adapters: the collectives that turn a value from its producer's layout into its consumer's.

`transition_steps(src, dst, grad_partial=...)` gives the cheapest sequence of
``nnscaler.runtime.comm`` functions (as ``(name, kwargs)``; generated code calls
``nr.comm.<name>(x, **kwargs, ranks=...)``) turning a value held by a group of ranks in
placement `src` into placement `dst` over the same ranks. ``dst = R`` with
``grad_partial=True`` is ``R*``: a replicated value read by a partitioned op, whose ranks each
produce only a partial gradient for it.

===========  ==========  ==========================  ========================  ==================
src \\ dst    R           R*                          V                         D(j)
===========  ==========  ==========================  ========================  ==================
R            --          grad_all_reduce             to_partial                split(j)
V            all_reduce  all_reduce_ar               --                        reduce_scatter(j)
D(i)         all_gather  all_gather_rs               shard_to_partial          all_to_all(i, j)
                                                                               (-- when i == j)
===========  ==========  ==========================  ========================  ==================

Each is one step, and each moves the fewest bytes its layouts allow (forward and backward
together): going through R or V on the way would add a collective on at least one side.
`steps_cost` gives the analytic bytes sent per rank of a sequence, `step_collectives` the
collectives it runs.
"""
from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

from nnscaler.ir.layout import Partial, Replicate, Shard, TensorLayout

__all__ = ["transition_steps", "steps_cost", "step_collectives", "STEP_COLLECTIVES", "CommCost",
           "COST_MODELS"]

Step = Tuple[str, Dict[str, int]]

# function name -> (collectives of its forward, collectives of its backward)
STEP_COLLECTIVES: Dict[str, Tuple[Tuple[str, ...], Tuple[str, ...]]] = {
    "split": ((), ("all_gather",)),
    "all_gather": (("all_gather",), ()),
    "all_reduce": (("all_reduce",), ()),
    "reduce_scatter": (("reduce_scatter",), ("all_gather",)),
    "all_to_all": (("all_to_all",), ("all_to_all",)),
    "to_partial": ((), ()),
    "shard_to_partial": ((), ()),
    "grad_all_reduce": ((), ("all_reduce",)),
    "all_gather_rs": (("all_gather",), ("reduce_scatter",)),
    "all_reduce_ar": (("all_reduce",), ("all_reduce",)),
}


def _ring(collective: str, b: float, n: int) -> float:
    return {"all_reduce": 2 * (n - 1) / n * b, "all_gather": (n - 1) / n * b,
            "reduce_scatter": (n - 1) / n * b, "all_to_all": (n - 1) / n * b / n}[collective]


def _payload(collective: str, b: float, n: int) -> float:
    return {"all_reduce": b, "all_gather": b / n, "reduce_scatter": b, "all_to_all": b / n}[collective]


# Bytes one rank sends per collective, for a full tensor of B bytes over n ranks.
#   ring:    bytes on the wire with ring all-reduce / all-gather / reduce-scatter and pairwise
#            all-to-all (the bandwidth-optimal algorithms; NCCL's and gloo's defaults).
#   payload: bytes of the tensor the rank hands to the collective; what
#            `nnscaler.runtime.comm` stats count ("bytes"), so measured == analytic exactly.
COST_MODELS = {"ring": _ring, "payload": _payload}


class CommCost(NamedTuple):
    """Bytes sent per rank by a step sequence: in the forward and in the backward pass."""

    forward: float
    backward: float

    @property
    def total(self) -> float:
        return self.forward + self.backward


def _placement_of(p, what: str) -> Tuple[object, Optional[int]]:
    if isinstance(p, TensorLayout):
        return p.placement, len(p.shape)
    if isinstance(p, (Replicate, Partial, Shard)):
        return p, None
    raise TypeError(f"{what} must be a placement (Replicate(), Partial(), Shard(dim)) or a "
                    f"TensorLayout, got {p!r}")


def _dim(p: Shard, ndim: Optional[int]) -> int:
    dim = p.dim
    if ndim is not None:
        if not -ndim <= dim < ndim:
            raise ValueError(f"{p!r} is out of range for a {ndim}-dimensional tensor")
        dim %= ndim
    return dim


def transition_steps(src, dst, *, grad_partial: bool = False, ndim: Optional[int] = None,
                     n: Optional[int] = None) -> List[Step]:
    """The `nnscaler.runtime.comm` calls turning placement `src` into `dst` (same ranks).

    `src`/`dst` are placements or `TensorLayout`s. `grad_partial=True` with a replicated `dst`
    asks for R* (the consumer is a partitioned op). `ndim` (taken from a TensorLayout when
    given one) normalises negative shard dims; without it ``D(-1)`` and ``D(2)`` are compared
    as written (the runtime still makes an all-to-all between equal dims the identity). `n`,
    when 1, needs no step. Returns ``[]`` when nothing is needed.
    """
    src, src_ndim = _placement_of(src, "src")
    dst, dst_ndim = _placement_of(dst, "dst")
    ndim = ndim if ndim is not None else (src_ndim if src_ndim is not None else dst_ndim)
    if grad_partial and not isinstance(dst, Replicate):
        raise ValueError(f"grad_partial applies to a replicated destination (R*), not to {dst!r}")
    if n == 1:
        return []
    if isinstance(src, Shard):
        i = _dim(src, ndim)
        if isinstance(dst, Replicate):
            return [("all_gather_rs" if grad_partial else "all_gather", {"dim": i})]
        if isinstance(dst, Partial):
            return [("shard_to_partial", {"dim": i})]
        j = _dim(dst, ndim)
        return [] if i == j else [("all_to_all", {"src_dim": i, "dst_dim": j})]
    if isinstance(src, Partial):
        if isinstance(dst, Replicate):
            return [("all_reduce_ar" if grad_partial else "all_reduce", {})]
        if isinstance(dst, Partial):
            return []
        return [("reduce_scatter", {"dim": _dim(dst, ndim)})]
    # src replicated
    if isinstance(dst, Replicate):
        return [("grad_all_reduce", {})] if grad_partial else []
    if isinstance(dst, Partial):
        return [("to_partial", {})]
    return [("split", {"dim": _dim(dst, ndim)})]


def step_collectives(steps: Sequence[Step]) -> Tuple[List[str], List[str]]:
    """(collectives run in the forward, collectives run in the backward), in run order."""
    fwd: List[str] = []
    bwd: List[str] = []
    for name, _ in steps:
        if name not in STEP_COLLECTIVES:
            raise ValueError(f"unknown step {name!r}; known: {sorted(STEP_COLLECTIVES)}")
        f, b = STEP_COLLECTIVES[name]
        fwd.extend(f)
        bwd[:0] = b  # the backward runs the steps in reverse
    return fwd, bwd


def steps_cost(steps: Sequence[Step], full_nbytes: float, n: int, *, model: str = "ring") -> CommCost:
    """Analytic bytes sent per rank by `steps` on a full tensor of `full_nbytes` over `n` ranks.

    `model` is ``"ring"`` (wire bytes of bandwidth-optimal algorithms: all-reduce 2(n-1)/n*B,
    all-gather and reduce-scatter (n-1)/n*B, all-to-all (n-1)/n*B/n) or ``"payload"`` (what
    the runtime's stats count: all-reduce and reduce-scatter B, all-gather and all-to-all B/n).
    Gradients have the value's size, so the backward uses the same B.
    """
    if model not in COST_MODELS:
        raise ValueError(f"unknown cost model {model!r}; choose from {sorted(COST_MODELS)}")
    if n <= 1:
        return CommCost(0.0, 0.0)
    cost = COST_MODELS[model]
    fwd, bwd = step_collectives(steps)
    return CommCost(float(sum(cost(c, full_nbytes, n) for c in fwd)),
                    float(sum(cost(c, full_nbytes, n) for c in bwd)))
