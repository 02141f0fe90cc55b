"""The routed-experts operation of a mixture-of-experts layer, as one op of the traced program.

``routed_experts(hidden, top_k_index, top_k_weights, gate_up, down, ...)`` computes what a
transformers experts module computes (whatever its ``experts_implementation``): every token goes
to its ``k`` experts, each expert runs its MLP on the tokens it received, and each token's outputs
are summed weighted by its routing weights. The tracer records transformers' experts modules as
this op (``nnscaler.ir.tracer.moe_modules``); a user's own MoE module calls it directly.

Shapes: ``hidden`` (T, H), ``top_k_index`` (T, K) int, ``top_k_weights`` (T, K); ``gate_up`` (E, G,
H) and ``down`` (E, H, F), or (E, H, G) and (E, F, H) with ``transposed``; G = 2F for a gated MLP,
F otherwise; biases (E, G) and (E, H). Out: (T, H) in ``hidden``'s dtype.

Its annotation lets a policy split the tokens only (``t``): the index holds global expert ids, so
an expert slice cannot run on its own. Expert parallelism is the runtime's
(``nnscaler.runtime.moe.expert_parallel``): a piece whose ``dim`` is `EXPERT_DIM` holds tokens and
experts split over the unit and exchanges tokens by all-to-all. `dispatch_order`,
`expert_mlp` and `combine` are the steps both run.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.nn.functional as F

from ..tracer.tracing_context import current_tracer

__all__ = ["routed_experts", "ROUTED_EXPERTS", "EXPERT_DIM", "expert_group_dim", "expert_group", "packed_expert_width", "ExpertMLP", "ACTIVATIONS", "GATES",
           "dispatch_order", "expert_mlp", "combine", "routed_experts_annotation", "expert_capacity", "slot_counts",
           "kept_counts", "drop_over_capacity", "with_dropped"]

ROUTED_EXPERTS = "nnscaler.ir.ops.moe.routed_experts"
EXPERT_DIM = "e"  # the annotation's experts dim: a piece split along it is expert parallel


def expert_group_dim(group: int) -> str:
    """A piece's dim when the tokens of expert parallelism are exchanged inside groups of `group` of the
    unit's devices (the experts stored split over the whole unit, as along `EXPERT_DIM`): ``"e:2"``."""
    return f"{EXPERT_DIM}:{int(group)}"


def packed_expert_width(numel: int) -> int:
    """The elements one expert's weight (`numel` of them) takes in the packed row that expert
    parallelism with groups (``e:k``) gathers: padded to 16 elements, so that each weight's view of
    the gathered rows starts and strides on 16 bytes (nnscaler.runtime.expert_groups)."""
    return -(-int(numel) // 16) * 16


def expert_group(dim) -> "tuple":
    """(is expert parallel, group size or None for the whole unit) of a piece's `dim`."""
    base, sep, group = (dim or "").partition(":")
    if base != EXPERT_DIM:
        return False, None
    return True, (int(group) if sep else None)

ACTIVATIONS = {
    "silu": F.silu, "swish": F.silu, "gelu": F.gelu, "relu": F.relu, "sigmoid": torch.sigmoid, "tanh": torch.tanh,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
}
# glu: [gate; up] halves, act(gate) * up (transformers' default); none: act(up), no gate;
# clamped_swiglu: interleaved gate/up, clamped, (up + 1) * gate * sigmoid(alpha * gate) (gpt-oss)
GATES = ("glu", "none", "clamped_swiglu")


@dataclass(frozen=True)
class ExpertMLP:
    """How one expert's MLP computes: the activation, the gate and the weights' layout."""

    activation: str = "silu"
    gate: str = "glu"
    transposed: bool = False
    alpha: float = 1.0
    limit: float = 0.0

    def __post_init__(self):
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"routed_experts: activation {self.activation!r} is not one of "
                             f"{sorted(ACTIVATIONS)}")
        if self.gate not in GATES:
            raise ValueError(f"routed_experts: gate {self.gate!r} is not one of {GATES}")

    def linear(self, x, weight, bias=None):
        y = x @ weight if self.transposed else x @ weight.t()
        return y if bias is None else y + bias

    def gated(self, h):
        act = ACTIVATIONS[self.activation]
        if self.gate == "none":
            return act(h)
        if self.gate == "glu":
            g, up = h.chunk(2, dim=-1)
            return act(g) * up
        g, up = h[..., ::2].clamp(max=self.limit), h[..., 1::2].clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (g * torch.sigmoid(g * self.alpha))


def dispatch_order(top_k_index: torch.Tensor, num_experts: int):
    """(order, counts): the (token, slot) pairs sorted by expert (a stable sort of the flattened
    index), and the number of pairs per expert (a (num_experts,) tensor)."""
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    return order, torch.bincount(flat, minlength=num_experts)[:num_experts]


# -- capacity (token dropping) -----------------------------------------------------------------
# GShard / Switch semantics, defined on the whole batch of the call: each expert keeps at most
# `expert_capacity` (token, slot) pairs, in priority order: every token's first choice before any
# second choice, ..., and within a slot the tokens in batch order (under expert parallelism: the
# pieces in order, then each piece's tokens). A dropped pair adds nothing to its token's output (the
# model's residual carries the token on).

def expert_capacity(tokens: int, k: int, num_experts: int, capacity_factor: float) -> int:
    """The pairs each expert keeps: ceil(capacity_factor * tokens * k / num_experts)."""
    return math.ceil(capacity_factor * tokens * k / num_experts)


def slot_counts(top_k_index: torch.Tensor, num_experts: int) -> torch.Tensor:
    """(K, E) int64: the pairs of each slot routed to each expert."""
    k = top_k_index.shape[1]
    return torch.stack([torch.bincount(top_k_index[:, s], minlength=num_experts)[:num_experts] for s in range(k)]) \
        if top_k_index.shape[0] else torch.zeros(k, num_experts, dtype=torch.int64, device=top_k_index.device)


def kept_counts(counts: torch.Tensor, capacity: int) -> torch.Tensor:
    """(n, K, E): of each piece's pairs per (slot, expert) (`counts`, pieces in batch order), how many
    their expert keeps (the priority order above)."""
    n, k, e = counts.shape
    ordered = counts.permute(1, 0, 2).reshape(k * n, e)  # slot-major, then piece
    ahead = ordered.cumsum(0) - ordered
    kept = (capacity - ahead).clamp(min=0).minimum(ordered)
    return kept.reshape(k, n, e).permute(1, 0, 2)


def drop_over_capacity(top_k_index: torch.Tensor, kept_here: torch.Tensor, num_experts: int) -> torch.Tensor:
    """`top_k_index` with each dropped pair's expert set to `num_experts` (past the last expert:
    `dispatch_order` then sorts it last and counts it nowhere); `kept_here` (K, E): this piece's kept
    pairs per (slot, expert), its first ones in token order."""
    tokens, k = top_k_index.shape
    out = top_k_index.clone()
    positions = torch.arange(tokens, device=top_k_index.device)
    for s in range(k):
        experts = top_k_index[:, s]
        order = torch.argsort(experts, stable=True)
        counts = torch.bincount(experts, minlength=num_experts)
        start = counts.cumsum(0) - counts
        rank = torch.empty_like(positions)
        rank[order] = positions - start[experts[order]]  # among this slot's pairs for its expert
        out[:, s] = torch.where(rank < kept_here[s].to(rank.device)[experts], experts, num_experts)
    return out


def expert_mlp(x: torch.Tensor, counts: List[int], gate_up, down, gate_up_bias, down_bias,
               mlp: ExpertMLP) -> torch.Tensor:
    """Each expert's MLP on its rows of `x` (rows sorted by expert, `counts[e]` rows for expert e).
    A grouped GEMM on CUDA in bfloat16 / float16 where torch has one, else a loop over experts."""
    if _grouped_mm_ok(x, gate_up, mlp):
        offs = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
        w1 = gate_up if mlp.transposed else gate_up.transpose(1, 2)
        w2 = down if mlp.transposed else down.transpose(1, 2)
        h = F.grouped_mm(x.to(w1.dtype), w1, offs=offs)
        if gate_up_bias is not None:
            h = h + _rows_bias(gate_up_bias, counts)
        h = F.grouped_mm(mlp.gated(h), w2, offs=offs)
        return h if down_bias is None else h + _rows_bias(down_bias, counts)
    outs = []
    for e, rows in enumerate(torch.split(x, counts, dim=0)):
        if rows.shape[0] == 0:
            continue
        h = mlp.gated(mlp.linear(rows, gate_up[e], None if gate_up_bias is None else gate_up_bias[e]))
        outs.append(mlp.linear(h, down[e], None if down_bias is None else down_bias[e]))
    if not outs:  # no rows here: still an output with a gradient path to `x` and every weight, so that
        # every rank's backward runs the same collectives (expert parallelism; docs/moe.md)
        h = mlp.gated(mlp.linear(x, gate_up[0], None if gate_up_bias is None else gate_up_bias[0]))
        return mlp.linear(h, down[0], None if down_bias is None else down_bias[0])
    return torch.cat(outs, dim=0)


def _grouped_mm_ok(x, weight, mlp: ExpertMLP) -> bool:
    return x.is_cuda and weight.dtype in (torch.bfloat16, torch.float16) and hasattr(F, "grouped_mm")


def _rows_bias(bias, counts):
    return torch.repeat_interleave(bias, torch.tensor(counts, device=bias.device), dim=0)


def combine(y_sorted: torch.Tensor, order: torch.Tensor, top_k_weights: torch.Tensor, dtype) -> torch.Tensor:
    """Each token's expert outputs (rows in `order`) weighted by its routing weights and summed."""
    tokens, k = top_k_weights.shape
    y = y_sorted.index_select(0, torch.argsort(order))  # back to (token, slot) order
    weighted = y.view(tokens, k, -1) * top_k_weights.unsqueeze(-1)
    return weighted.to(dtype).sum(dim=1)


def routed_experts(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                   gate_up: torch.Tensor, down: torch.Tensor, gate_up_bias: Optional[torch.Tensor] = None,
                   down_bias: Optional[torch.Tensor] = None, *, activation: str = "silu", gate: str = "glu",
                   transposed: bool = False, alpha: float = 1.0, limit: float = 0.0,
                   capacity_factor: Optional[float] = None) -> torch.Tensor:
    """Route every token of `hidden` to its `top_k_index` experts and sum their MLP outputs weighted
    by `top_k_weights`: dropless (every expert takes every token sent to it), or with
    `capacity_factor` each expert keeps at most `expert_capacity` pairs of the batch (the priority order
    above) and the others add nothing. See the module docstring for shapes; `activation` names one of
    `ACTIVATIONS`, `gate` one of `GATES`."""
    mlp = ExpertMLP(activation, gate, transposed, float(alpha), float(limit))
    num_experts = gate_up.shape[0]
    tokens, k = top_k_index.shape
    if k > num_experts:
        raise ValueError(f"routed_experts: each token is routed to top-k = {k} experts, but there are only "
                         f"{num_experts} experts (gate_up has shape {tuple(gate_up.shape)}): num_experts_per_tok "
                         f"must be at most the number of experts")
    if hidden.is_meta:  # a meta trace (a model built on the meta device): no routing values, the result's shape
        return torch.empty_like(hidden)
    if capacity_factor is not None:
        capacity = expert_capacity(tokens, k, num_experts, _check_capacity_factor(capacity_factor))
        kept = kept_counts(slot_counts(top_k_index, num_experts).unsqueeze(0), capacity)[0]
        top_k_index = drop_over_capacity(top_k_index, kept, num_experts)
    order, counts = dispatch_order(top_k_index, num_experts)
    rows = int(counts.sum())
    x = hidden.index_select(0, torch.div(order[:rows], k, rounding_mode="floor"))
    y = expert_mlp(x, counts.tolist(), gate_up, down, gate_up_bias, down_bias, mlp)
    return combine(with_dropped(y, tokens * k), order, top_k_weights, hidden.dtype)


def with_dropped(y: torch.Tensor, pairs: int) -> torch.Tensor:
    """The kept pairs' outputs followed by zeros for the dropped ones (sorted last), `pairs` rows."""
    return y if y.shape[0] == pairs else torch.cat([y, y.new_zeros((pairs - y.shape[0],) + tuple(y.shape[1:]))])


def _check_capacity_factor(capacity_factor) -> float:
    if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float)) or not capacity_factor > 0:
        raise ValueError(f"routed_experts: capacity_factor must be a number > 0 (each expert keeps at most "
                         f"ceil(capacity_factor * tokens * top-k / experts) token slots; e.g. 1.25), or None "
                         f"for dropless routing; got {capacity_factor!r}")
    return float(capacity_factor)


def _recorded_whole(fn):
    """`fn`, recorded as one op while a trace runs (its torch calls are not traced through)."""
    @functools.wraps(fn)
    def op(*args, **kwargs):
        tracer = current_tracer()
        return fn(*args, **kwargs) if tracer is None else tracer.record_custom_op(fn, args, kwargs)

    op.__nnscaler_op__, fn.__nnscaler_wrapper__ = fn, op
    return op


routed_experts = _recorded_whole(routed_experts)


def routed_experts_annotation(hidden, top_k_index, top_k_weights, gate_up, down, gate_up_bias=None,
                              down_bias=None, *, transposed=False, capacity_factor=None, **_) -> str:
    """Tokens (``t``) split; experts, widths and slots stay whole (see the module docstring). With a
    capacity the tokens stay whole too (which pairs drop depends on the whole batch); only expert
    parallelism splits it then (`nnscaler.runtime.moe`, which counts over the unit)."""
    w1, w2 = ("e^ h^ g^", "e^ f^ h^") if transposed else ("e^ g^ h^", "e^ h^ f^")
    t = "t^" if capacity_factor is not None else "t"
    ins = [f"{t} h^", f"{t} k^", f"{t} k^", w1, w2]
    if gate_up_bias is not None:
        ins.append("e^ g^")
    if down_bias is not None:
        ins.append("e^ h^")
    return f"{', '.join(ins)} -> {t} h^"
