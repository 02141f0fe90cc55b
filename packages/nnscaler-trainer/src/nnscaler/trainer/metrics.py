"""What a step reports: the metrics handed to loggers and to the before_log_* hooks."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

__all__ = ["MoEMetrics", "TrainStepMetrics", "ValMetrics"]


@dataclass
class MoEMetrics:
    """A mixture-of-experts step (`nnscaler.trainer.moe`); a value is None when the run has none."""

    # the router's auxiliary (load-balancing) loss before router_aux_loss_coef: the mean over the
    # micro-batches of all replicas (each computed over its whole micro-batch, as the plan runs it)
    aux_loss: Optional[float] = None
    # the busiest expert's tokens over the mean tokens per expert (1.0: balanced), averaged over the
    # expert-parallel layer calls of the step and the ranks; None without expert parallelism
    expert_imbalance: Optional[float] = None
    # per MoE layer (the experts module's path), the (token, slot) pairs the router sent to each expert
    # over the step's global batch (all micro-batches and replicas); None without expert parallelism
    tokens_per_expert: Optional[Dict[str, List[float]]] = None
    # with a capacity factor: the pairs the experts' capacity dropped over the global batch, and their
    # share of all pairs; None without one
    dropped_tokens: Optional[float] = None
    dropped_fraction: Optional[float] = None

    def scalars(self) -> Dict[str, float]:
        """aux_loss, expert_imbalance, dropped_tokens, dropped_fraction and one
        ``tokens_per_expert/<layer>/<expert>`` per expert of each layer (those the run has)."""
        out = {"aux_loss": self.aux_loss, "expert_imbalance": self.expert_imbalance,
               "dropped_tokens": self.dropped_tokens, "dropped_fraction": self.dropped_fraction}
        for layer, counts in (self.tokens_per_expert or {}).items():
            out.update({f"tokens_per_expert/{layer}/{e}": c for e, c in enumerate(counts)})
        return {k: float(v) for k, v in out.items() if v is not None}


@dataclass
class TrainStepMetrics:
    """One optimizer step. Hooks may edit it (``before_log_train_metrics``) before it is logged."""

    epoch: int
    step: int  # global optimizer steps done, this one included
    train_loss: float
    lr: float
    gnorm: Optional[float] = None
    samples_per_s: Optional[float] = None
    tokens_per_s: Optional[float] = None
    step_time_s: Optional[float] = None
    memory_mb: Optional[float] = None
    moe: Optional[MoEMetrics] = None  # mixture-of-experts models: aux_loss, expert_imbalance
    extra: Dict[str, Any] = field(default_factory=dict)  # anything a hook adds; logged too

    def scalars(self) -> Dict[str, float]:
        """The numeric values to log, by name (None left out)."""
        out = {"loss": self.train_loss, "lr": self.lr, "gnorm": self.gnorm, "samples_per_s": self.samples_per_s,
               "tokens_per_s": self.tokens_per_s, "step_time_s": self.step_time_s, "memory_mb": self.memory_mb,
               "epoch": self.epoch}
        if self.moe is not None:
            out.update(self.moe.scalars())
        out.update(self.extra)
        return {k: float(v) for k, v in out.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


@dataclass
class ValMetrics:
    """One validation run."""

    epoch: int
    step: int
    val_loss: float
    num_batches: int = 0
    extra: Dict[str, Any] = field(default_factory=dict)

    def scalars(self) -> Dict[str, float]:
        out = {"loss": self.val_loss}
        out.update(self.extra)
        return {k: float(v) for k, v in out.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
