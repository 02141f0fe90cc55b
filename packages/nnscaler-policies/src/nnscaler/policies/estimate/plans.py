"""The plan, workload and estimate records of the plan estimator: `Plan` (tp, pp, dp, ZeRO, micro-batch,
recomputation, virtual stages, zero groups, ep, cp; checked on construction), `Workload` (GPUs, sequence
length, global batch, the MoE load imbalance) and `Estimate` (one plan's predicted step and memory,
`plan_cost.estimate_plan`'s result)."""
from __future__ import annotations

import dataclasses
from typing import Dict

from nnscaler.ir import ConfigError

from . import costs

__all__ = ["MOE_IMBALANCE", "Plan", "Estimate", "Workload", "ZERO_STAGES", "zero_label"]

ZERO_STAGES = (0, 1, 3)
# The busiest expert-parallel rank's routed tokens over the mean (router load imbalance left after
# the auxiliary balancing loss): an assumption, not a measurement; `--moe-imbalance` changes it.
MOE_IMBALANCE = 1.1


@dataclasses.dataclass(frozen=True)
class Plan:
    tp: int
    pp: int
    dp: int
    # ZeRO stage (ComputeConfig.use_zero): 0 none; 1 optimizer state sharded over the zero group;
    # 3 parameters, gradients and optimizer state sharded (fully sharded; no pipeline: pp must be 1)
    zero: int
    micro_batch: int  # sequences per micro-batch per data-parallel rank
    recompute: bool  # every decoder layer recomputed in backward
    virtual: int = 1  # pipeline stages per GPU: 1 is 1F1B, more is interleaved 1F1B
    zero_ngroups: int = 1  # ComputeConfig.zero_ngroups: the dp ranks split into this many zero groups
    ep: int = 1  # expert parallel: the routed experts split over ep of the dp ranks (mixture of experts)
    cp: int = 1  # context parallel: every sequence split over cp ranks (ring attention); GPUs = tp·cp·pp·dp

    def __post_init__(self):
        if self.zero not in ZERO_STAGES:
            raise ConfigError(f"Plan.zero must be one of {ZERO_STAGES} (ComputeConfig.use_zero's stages), "
                              f"got {self.zero!r}")
        if self.zero_ngroups < 1 or self.dp % self.zero_ngroups or (self.zero_ngroups > 1 and not self.zero):
            raise ConfigError(f"Plan.zero_ngroups ({self.zero_ngroups}) must divide dp ({self.dp}), and needs "
                              f"zero 1 or 3 when above 1")
        if isinstance(self.cp, bool) or not isinstance(self.cp, int) or self.cp < 1:
            raise ConfigError(f"Plan.cp must be a whole number >= 1 (the context-parallel degree), got {self.cp!r}")
        if isinstance(self.ep, bool) or not isinstance(self.ep, int) or self.ep < 1 or self.ep_pool % self.ep:
            pool = f"cp ({self.cp}): with context parallelism" if self.cp > 1 else f"dp ({self.dp}):"
            raise ConfigError(f"Plan.ep ({self.ep!r}) must be a whole number >= 1 dividing {pool} the "
                              f"expert-parallel ranks are carved out of the "
                              f"{'context' if self.cp > 1 else 'data'}-parallel ones")

    @property
    def ep_pool(self) -> int:
        """The ranks ep is carved out of: the cp ranks with context parallelism (the runtime's cp policy
        splits the experts over its unit), else the dp ranks."""
        return self.cp if self.cp > 1 else self.dp

    @property
    def zero_group(self) -> int:
        """Ranks one ZeRO shard is spread over: dp·cp / zero_ngroups with ZeRO, else 1."""
        return self.dp * self.cp // self.zero_ngroups if self.zero else 1

    @property
    def family(self) -> str:
        return (f"tp{self.tp}" + (f" cp{self.cp}" if self.cp > 1 else "") + f" pp{self.pp} dp{self.dp}"
                + (f" ep{self.ep}" if self.ep > 1 else ""))

    def describe(self) -> str:
        return (f"{self.family}" + (f" v{self.virtual}" if self.virtual > 1 else "")
                + zero_label(self.zero, self.zero_ngroups)
                + f" mb{self.micro_batch}" + (" recompute" if self.recompute else ""))


def zero_label(zero: int, ngroups: int = 1) -> str:
    """' zero1', ' zero3', ' zero3/g2' (two zero groups) or '' without ZeRO: a plan name's part."""
    return (f" zero{zero}" + (f"/g{ngroups}" if ngroups > 1 else "")) if zero else ""


@dataclasses.dataclass(frozen=True)
class Workload:
    gpus: int
    seq: int
    global_batch_tokens: int
    moe_imbalance: float = MOE_IMBALANCE  # mixture of experts: the busiest rank's expert compute over the mean

    @property
    def sequences(self) -> int:
        return self.global_batch_tokens // self.seq


@dataclasses.dataclass
class Estimate:
    plan: Plan
    nmicros: int
    step_s: float
    compute_s: float  # nmicros x the slowest stage's compute (recomputation included)
    bubble_s: float
    tp_comm_s: float
    pp_comm_s: float
    dp_comm_s: float  # exposed data-parallel sync (+ ZeRO-1's all-gather after the step, ZeRO-3's gathers)
    optimizer_s: float
    memory_bytes: float
    memory_parts: Dict[str, float]
    fits: bool
    model_flops: float
    tokens_per_s: float
    tflops_per_gpu: float
    mfu: float
    ep_comm_s: float = 0.0  # the MoE layers' dispatch and combine all-to-alls
    cp_comm_s: float = 0.0  # the context-parallel ring's transfers that attention does not hide

    @property
    def comm_s(self) -> float:
        return self.tp_comm_s + self.pp_comm_s + self.dp_comm_s + self.ep_comm_s + self.cp_comm_s

    @property
    def memory_gb(self) -> float:
        return self.memory_bytes / costs.GiB
