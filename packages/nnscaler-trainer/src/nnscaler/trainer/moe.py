"""Mixture-of-experts numbers of a training step: the router's auxiliary loss and the experts' load.

- `MoEModel`: a model class says which output of its forward is the router's auxiliary loss
  (``aux_loss_output``; `nnscaler.trainer.hf.CausalLM` sets it for MoE configs);
- `MoEMeter`: per step, the mean of that output over the micro-batches of all replicas, and the
  expert load of the expert-parallel forwards (``nnscaler.runtime.moe.expert_load()``: per layer the
  step's tokens per expert, summed over its micro-batches; the busiest expert's over the mean,
  averaged over layers, then over ranks), reset every step; one all-reduce of four numbers; and the
  global batch's tokens per expert of each layer and, with a capacity factor, the (token, slot) pairs
  dropped (one all_gather_object of every rank's own counts). The Trainer puts them in
  ``TrainStepMetrics.moe`` (`MoEMetrics`), hence in the console line and the loggers.
"""
from __future__ import annotations

from typing import Any, List, Optional

import torch
import torch.distributed as dist

from .metrics import MoEMetrics

__all__ = ["MoEModel", "MoEMeter", "balance_if_asked"]


def balance_if_asked(original: torch.nn.Module, model: torch.nn.Module) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing of every ParallelModule of `model` when the
    user's model asks for it (``load_balance_coeff``, e.g. `nnscaler.trainer.hf.CausalLM`'s)."""
    coeff = getattr(original, "load_balance_coeff", None)
    if coeff is None:
        return
    from nnscaler.runtime import ParallelModule
    from nnscaler.runtime import moe as runtime_moe
    for pm in [m for m in model.modules() if isinstance(m, ParallelModule)]:
        runtime_moe.balance_experts(pm, coeff)


class MoEModel:
    """Mixin of an end2end mixture-of-experts model: its forward returns a tuple whose output
    `aux_loss_output` (an index, e.g. 1 for ``(loss, aux_loss)``) is the router's auxiliary
    loss, a scalar; the Trainer logs it as ``aux_loss``. None: the model returns none (the expert
    load is logged all the same under ``pas_policy: ep``)."""

    aux_loss_output: Optional[int] = None


def _uses_ep(args) -> bool:
    from nnscaler.policies import resolve_policy
    if args.uses_parallel_modules:
        policies = [pm.pas_policy or args.pas_policy for pm in args.model.parallel_modules]
    else:
        policies = [args.pas_policy]
    return any(resolve_policy(p).name == "ep" for p in policies)


class MoEMeter:
    """One step's `MoEMetrics` on every rank (`end` is collective over all ranks)."""

    def __init__(self, aux_loss_output: Optional[int]):
        self.aux_loss_output = aux_loss_output

    @classmethod
    def for_run(cls, args, model: torch.nn.Module) -> Optional["MoEMeter"]:
        """A meter when the model returns an auxiliary loss or a policy is ``ep``, else None
        (the same answer on every rank: it decides whether `end` communicates)."""
        index = model.aux_loss_output if isinstance(model, MoEModel) else None
        if index is None and not _uses_ep(args):
            return None
        return cls(index)

    def begin(self) -> None:
        """Forget the expert load recorded so far (e.g. by validation)."""
        _expert_load().reset()

    def end(self, outputs: List[Any]) -> MoEMetrics:
        """The step's metrics from its micro-batch outputs and the load recorded since `begin`."""
        index = self.aux_loss_output
        aux = [float(out[index]) for out in outputs  # (pipelines: only the last stage holds outputs)
               if index is not None and isinstance(out, (tuple, list)) and len(out) > index and out[index] is not None]
        load = _expert_load()
        routed = any(float(c.sum()) > 0 for c in load.per_call)
        imbalance = load.imbalance() if routed else 0.0
        own = {layer: c.tolist() for layer, c in load.own.items()}
        dropped = dict(load.dropped)
        load.reset()
        stats = torch.tensor([sum(aux), len(aux), imbalance, 1.0 if routed else 0.0], dtype=torch.float64)
        stats = _all_reduce_sum(stats)
        per_expert, dropped_total = _global_load(own, dropped)
        total = sum(sum(c) for c in per_expert.values())
        return MoEMetrics(aux_loss=float(stats[0] / stats[1]) if stats[1] else None,
                          expert_imbalance=float(stats[2] / stats[3]) if stats[3] else None,
                          tokens_per_expert=per_expert or None, dropped_tokens=dropped_total,
                          dropped_fraction=dropped_total / total if dropped_total is not None and total else None)


def _global_load(own, dropped):
    """({layer: tokens per expert}, pairs dropped or None) of the step's global batch: every rank's
    own tokens summed (one all_gather_object over all ranks; pipeline stages hold different layers)."""
    parts = [(own, dropped)]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, (own, dropped))
    per_expert, total, any_dropped = {}, 0.0, False
    for rank_own, rank_dropped in parts:
        for layer, counts in rank_own.items():
            per_expert[layer] = [a + b for a, b in zip(per_expert[layer], counts)] if layer in per_expert else counts
        total += sum(rank_dropped.values())
        any_dropped = any_dropped or bool(rank_dropped)
    return per_expert, (total if any_dropped else None)


def _expert_load():
    from nnscaler.runtime import moe
    return moe.expert_load()


def _all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return t
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    t = t.to(device)
    dist.all_reduce(t)
    return t.cpu()
