"""Expert parallelism: the routed experts of a mixture-of-experts layer split over a unit's ranks.

Under the `ep` policy the generated code calls ``nr.moe.expert_parallel(hidden, top_k_index,
top_k_weights, gate_up, down, ..., ranks=(...))`` in place of ``routed_experts``
(``nnscaler.ir.ops.moe``): piece i of the unit holds 1/n of the tokens and experts
``[i * E/n, (i + 1) * E/n)``. Each rank sorts its (token, slot) pairs by expert, tells every rank
how many rows it sends to each of its experts (an all-gather of the per-expert counts), sends the
rows to their experts' ranks (all-to-all with variable counts: dropless, nothing padded), runs its
experts' MLPs on what it received, sends the outputs back the same way, and combines them with the
routing weights. Forward and backward are exactly `routed_experts` on the whole batch: the
backward of each exchange is the exchange the other way. With ``ep_size`` k between 1 and n the
storage is the same, the tokens travel inside groups of k ranks and each rank gathers the experts
its group position computes (`nnscaler.runtime.expert_groups`).

`expert_load()` holds what the step's training forwards routed (tokens per expert, per layer, summed
over the unit; bounded: one tensor per layer); `comm.stats` counts the exchanged rows.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from nnscaler.ir import (ExpertMLP, combine_experts as combine, drop_over_capacity, expert_capacity, expert_mlp,
                         experts_dispatch_order as dispatch_order, kept_counts, slot_counts, with_dropped)

from .comm.exchange import exchange_rows
from .expert_groups import expert_groups, gather_experts, group_expert_ids
from .comm.flat import all_gather_flat
from . import failures
from .comm.primitives import CommError, as_ranks, resolve

__all__ = ["expert_parallel", "ExpertLoad", "expert_load", "balance_experts", "BIAS_NAME"]

BIAS_NAME = "e_score_correction_bias"  # DeepSeek-V3's router bias, moved by `balance_experts`
_BALANCE = "_nnscaler_load_balance_coeff"


@dataclass
class ExpertLoad:
    """The tokens (token-slot pairs) each expert received in this step's training forwards, per MoE
    layer (``layer``: the experts module's path, which generated code passes), summed over the
    ranks of the layer's unit and over the step's micro-batches: one tensor per layer, so the record
    stays bounded however long training runs. A step ends at the optimizer's step (`build_optimizer`'s
    calls `end_step`; a loop with another optimizer calls it itself): the record keeps the ended
    step's load until the next training forward starts a new one. Forwards without autograd
    (evaluation) and recomputation during backward are not recorded."""

    per_layer: Dict[str, torch.Tensor] = field(default_factory=dict)
    ended: bool = False
    # this rank's own tokens' choices per expert (summed over all ranks: the global batch's load), and
    # of them the (token, slot) pairs its experts' capacity dropped (only with a capacity factor)
    own: Dict[str, torch.Tensor] = field(default_factory=dict)
    dropped: Dict[str, float] = field(default_factory=dict)

    def reset(self) -> None:
        self.per_layer.clear()
        self.own.clear()
        self.dropped.clear()
        self.ended = False

    def end_step(self) -> None:
        """The step is over: the next `add` starts the next step's record."""
        self.ended = True

    def add(self, counts: torch.Tensor, layer: Optional[str] = None, own: Optional[torch.Tensor] = None,
            dropped: Optional[float] = None) -> None:
        """Add one forward's tokens per expert of `layer` (None: a call of its own, named by its order);
        `own`: of them, this rank's tokens'; `dropped`: this rank's pairs dropped over capacity."""
        if self.ended:
            self.reset()
        key = layer if layer is not None else f"call {len(self.per_layer)}"
        counts = counts.detach().to("cpu", torch.float64)
        self.per_layer[key] = self.per_layer[key] + counts if key in self.per_layer else counts
        if own is not None:
            own = own.detach().to("cpu", torch.float64)
            self.own[key] = self.own[key] + own if key in self.own else own
        if dropped is not None:
            self.dropped[key] = self.dropped.get(key, 0.0) + float(dropped)

    @property
    def per_call(self) -> List[torch.Tensor]:
        """The layers' loads, in the order each layer was first called in the step."""
        return list(self.per_layer.values())

    def imbalance(self) -> float:
        """The busiest expert's load over the mean load, averaged over the layers (1.0: balanced)."""
        ratios = [float(c.max() / c.mean()) for c in self.per_layer.values() if float(c.sum()) > 0]
        return sum(ratios) / len(ratios) if ratios else 1.0


_LOAD = ExpertLoad()


def expert_load() -> ExpertLoad:
    """This process's record of the expert-parallel forwards of the current (or just ended) step
    (see `ExpertLoad`)."""
    return _LOAD


def _training_forward() -> bool:
    """A forward that builds an autograd graph and is not a recomputation inside backward."""
    return torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1


def expert_parallel(hidden, top_k_index, top_k_weights, gate_up, down, gate_up_bias=None, down_bias=None, *,
                    activation: str = "silu", gate: str = "glu", transposed: bool = False, alpha: float = 1.0,
                    limit: float = 0.0, capacity_factor: Optional[float] = None, ranks,
                    layer: Optional[str] = None, ep_size: Optional[int] = None) -> torch.Tensor:
    """`routed_experts` on this rank's tokens, with this rank's share of the experts (see the module
    docstring). COLLECTIVE over `ranks` (every rank of the unit calls it for the same layer), with the
    same collectives in the same order whatever the routing, forward and backward. `layer` names the
    layer in `expert_load()`. With `capacity_factor`, the pairs dropped are those `routed_experts`
    drops on the unit's whole batch (the count exchange carries counts per slot and expert, from which
    every rank derives every piece's kept pairs). With `ep_size` k below the ranks, each rank still
    stores 1/n of the experts, but the tokens are exchanged only inside its group of k consecutive
    ranks, whose rank at position p gathers the E/k experts it computes from its replica set
    (`nnscaler.runtime.expert_groups`); the load record and the dropped pairs stay the unit's, in the
    original expert ids."""
    ranks = as_ranks(ranks)
    unit = resolve(ranks, "moe.expert_parallel")
    num_experts = gate_up.shape[0] * unit.n  # every rank stores E/n experts
    groups = None
    if ep_size is not None and ep_size != unit.n:
        groups = expert_groups(ranks, ep_size, unit.index)
        gate_up, down, gate_up_bias, down_bias = gather_experts((gate_up, down, gate_up_bias, down_bias),
                                                                groups.replicas)
    mlp = ExpertMLP(activation, gate, transposed, float(alpha), float(limit))
    tokens, k = top_k_index.shape
    if top_k_index.numel() and int(top_k_index.max()) >= num_experts:
        raise CommError(f"nnscaler.runtime.moe.expert_parallel: an expert index is {int(top_k_index.max())}, "
                        f"but the layer has {num_experts} experts ({num_experts // unit.n} on each of {unit.n} ranks)")
    # every unit rank's counts per slot and expert (E per rank when dropless), in piece order, in the
    # original expert ids: the load record and which pairs drop are the unit's, whatever the groups
    counts = slot_counts(top_k_index, num_experts) if capacity_factor is not None else \
        torch.bincount(top_k_index.reshape(-1), minlength=num_experts)[:num_experts].unsqueeze(0)
    gathered = all_gather_flat(counts.reshape(-1).to(torch.int64), unit.group, unit.n, label=None,
                               what=f"the expert-parallel count exchange over ranks {ranks}")
    gathered = gathered.view(unit.n, -1, num_experts)
    if unit.to_piece is not None:  # group order -> piece order (piece p is group rank to_piece[p])
        gathered = gathered[torch.as_tensor([int(g) for g in unit.to_piece], device=gathered.device)]
    me = unit.index
    recorded = gathered
    if capacity_factor is not None:
        capacity = expert_capacity(tokens * unit.n, k, num_experts, float(capacity_factor))
        kept = kept_counts(gathered.cpu(), capacity)
        top_k_index = drop_over_capacity(top_k_index, kept[me].to(top_k_index.device), num_experts)
        gathered = kept
    if _training_forward():
        dropped = None if capacity_factor is None else int(recorded[me].sum()) - int(gathered[me].sum())
        _LOAD.add(recorded.sum((0, 1)), layer, own=recorded[me].sum(0), dropped=dropped)
    rs, n = unit, unit.n
    if groups is not None:  # from here on: the group's pieces and the group ids of the experts
        ids = group_expert_ids(num_experts, unit.n, ep_size)
        top_k_index = ids.to(top_k_index.device)[top_k_index]
        gathered = gathered.cpu()[groups.first:groups.first + ep_size][..., torch.argsort(ids[:-1])]
        rs, n, me = resolve(groups.group, "moe.expert_parallel"), ep_size, groups.position
    local = num_experts // n
    matrix = gathered.sum(1).tolist()  # matrix[src piece][expert]: the rows it sends there
    order, _ = dispatch_order(top_k_index, num_experts)  # a dropped pair sorts last
    send = [sum(matrix[me][j * local:(j + 1) * local]) for j in range(n)]  # rows to piece j
    recv = [sum(matrix[j][me * local:(me + 1) * local]) for j in range(n)]  # rows from piece j
    x = hidden.index_select(0, torch.div(order[:sum(send)], k, rounding_mode="floor"))
    xr = exchange_rows(x, send, recv, rs)
    # received rows are grouped by source piece, then expert: regroup them by expert
    mine = [matrix[j][me * local:(me + 1) * local] for j in range(n)]
    expert_of_row = torch.repeat_interleave(torch.arange(local).repeat(n),
                                            torch.tensor([c for row in mine for c in row], dtype=torch.int64))
    regroup = torch.argsort(expert_of_row, stable=True).to(hidden.device)  # small: built on the CPU
    per_expert = [sum(row[e] for row in mine) for e in range(local)]
    y = expert_mlp(xr.index_select(0, regroup), per_expert, gate_up, down, gate_up_bias, down_bias, mlp)
    y = y.index_select(0, torch.argsort(regroup))
    back = exchange_rows(y, recv, send, rs)
    return combine(with_dropped(back, tokens * k), order, top_k_weights, hidden.dtype)


# -- auxiliary-loss-free load balancing (DeepSeek-V3) --------------------------------------------

def balance_experts(module, load_balance_coeff: float) -> List[str]:
    """DeepSeek-V3's auxiliary-loss-free load balancing for the ParallelModule `module`: after every
    step of its optimizer (`build_optimizer`'s), each MoE layer's router bias (a buffer named
    `BIAS_NAME` in a module beside the layer's experts module) moves by `load_balance_coeff` with the
    sign rule, ``bias += coeff * sign(mean load - load)`` per expert, from the step's load: the tokens
    each expert received over the whole global batch (summed over the step's micro-batches and the
    data-parallel replicas: every rank computes the same update). Needs the experts split by ``ep``
    (`expert_parallel` records the load). Returns the biases' full names. The biases are buffers of
    the model: checkpoints hold them."""
    from .module import ParallelModule
    if isinstance(load_balance_coeff, bool) or not isinstance(load_balance_coeff, (int, float)) \
            or not load_balance_coeff >= 0:
        raise ValueError(f"balance_experts: load_balance_coeff must be a number >= 0 (the bias step per "
                         f"optimizer step, e.g. 1e-3), got {load_balance_coeff!r}")
    if not isinstance(module, ParallelModule):
        raise TypeError(f"balance_experts: {type(module).__name__} is not a ParallelModule: call it on what "
                        f"parallelize returned")
    names = [e.full_name for e in module.fullmap.values() if e.full_name.endswith("." + BIAS_NAME)]
    setattr(module, _BALANCE, float(load_balance_coeff))
    return names


def after_optimizer_step(root: torch.nn.Module) -> None:
    """What an optimizer step over `root` does to the experts: the biases of `balance_experts`
    (collective over each module's gradient-sync group), then the end of the load record's step. A
    second step without a training forward in between moves nothing (its load was used)."""
    if not _LOAD.ended:
        for pm in [m for m in root.modules() if getattr(m, _BALANCE, None) is not None]:
            _move_biases(pm, getattr(pm, _BALANCE))
    _LOAD.end_step()


def _move_biases(pm, coeff: float) -> None:
    targets = []
    for local, entry in pm.fullmap.items():
        if not entry.full_name.endswith("." + BIAS_NAME):
            continue
        block = entry.full_name[:-len(BIAS_NAME) - 1].rsplit(".", 1)[0]
        keys = [k for k in _LOAD.per_layer if k.rsplit(".", 1)[0] == block]
        if len(keys) != 1:
            raise CommError(f"balance_experts: {entry.full_name} has no expert-parallel load recorded in this step "
                            f"(layers recorded: {sorted(_LOAD.per_layer) or 'none'}): auxiliary-loss-free balancing "
                            f"reads the load that expert parallelism records; train with pas_policy 'ep'")
        targets.append((getattr(pm, local), _LOAD.per_layer[keys[0]]))
    if not targets:
        return
    loads = torch.stack([load for _, load in targets])
    grid = pm.grid
    if len(grid.sync_ranks) > 1:  # every unit's load: the global batch's
        loads = loads.to(targets[0][0].device)
        failures.run(dist.all_reduce, loads, group=grid.sync_group, what="the expert-load all-reduce")
    with torch.no_grad():
        for (bias, _), load in zip(targets, loads):
            load = load.to(bias.device, torch.float64)
            bias.add_((coeff * torch.sign(load.mean() - load)).to(bias.dtype))
