"""What `ep` and `cp` share: an optional pipeline asked through ``pas_config`` (as ``hybrid``
takes it), the devices an op runs on, and Megatron's tensor parallelism on the ops of the modules
``tp_modules`` names.

Keys: ``pp_size`` (> 1 pipelines: needs ``use_end2end=True`` and ``pipeline_nmicros``; stages
``pipeline_nstages``, default ``pp_size``; ``pipeline_scheduler``, ``pipeline_pivots`` as
``hybrid``), ``tp_modules`` (module path globs) with ``megatron``'s ``column`` / ``row`` / ``heads``.
"""
from __future__ import annotations

import fnmatch
from typing import Dict, Optional, Tuple

from nnscaler.ir import ConfigError

from ..pipeline import pivot_leads
from ._spread import split_over_unit
from .hybrid import COMMON_KEYS as PIPELINE_KEYS, _int, _pipeline, _scheduler
from .megatron import megatron_dim, megatron_globs, note_split

__all__ = ["UNIT_KEYS", "stage_if_asked", "devices_of", "TensorParallelModules"]

UNIT_KEYS = frozenset(PIPELINE_KEYS | {"tp_modules", "column", "row", "heads"})


def stage_if_asked(graph, cfg, policy: str) -> int:
    """Cut `graph` into pipeline stages when ``pas_config['pp_size'] > 1``; returns pp_size."""
    pas = dict(cfg.pas_config or {})
    pp_size = _int("pp_size", pas.get("pp_size", 1))
    if cfg.plan_ngpus % pp_size:
        raise ConfigError(f"pas_policy {policy!r}: plan_ngpus ({cfg.plan_ngpus}) must be a multiple of pp_size "
                          f"({pp_size})")
    if pp_size == 1:
        return 1
    if not cfg.use_end2end:
        raise ConfigError(f"pas_policy {policy!r} with pp_size > 1 pipelines the whole model and needs "
                          f"ComputeConfig(use_end2end=True) (train_step runs the micro-batches)")
    if "pipeline_nmicros" not in pas:
        raise ConfigError(f"pas_policy {policy!r} with pp_size > 1 needs pas_config['pipeline_nmicros'] "
                          f"(micro-batches per step)")
    nmicros, scheduler = _int("pipeline_nmicros", pas["pipeline_nmicros"]), _scheduler(policy, cfg, pas)
    nstages = _int("pipeline_nstages", pas.get("pipeline_nstages", pp_size))
    pivots = pas.get("pipeline_pivots")
    _pipeline(graph, cfg, nstages, pp_size, nmicros, scheduler, pivot_leads(graph, pivots) if pivots else None)
    return pp_size


def devices_of(graph, node, ngpus: int) -> Tuple[int, ...]:
    """The plan devices `node` runs on: its stage's, or the whole unit's."""
    return tuple(graph.pipeline.home_devices(node.stage)) if graph.pipeline is not None else tuple(range(ngpus))


class TensorParallelModules:
    """Megatron's rule on the ops inside the modules ``pas_config['tp_modules']`` names."""

    def __init__(self, pas: dict):
        value = pas.get("tp_modules", ())
        value = [value] if isinstance(value, str) else value
        if not isinstance(value, (list, tuple)) or not all(isinstance(g, str) and g for g in value):
            raise ConfigError(f"pas_config['tp_modules'] must be a module path glob or a list of them (e.g. "
                              f"['*.self_attn']), got {value!r}")
        self.modules = tuple(value)
        self.globs = megatron_globs(pas)
        self.split_on: Dict[int, int] = {}

    def dim(self, graph, node, devices) -> Optional[str]:
        """The dim Megatron splits `node` along, when it runs inside a `tp_modules` module."""
        if len(devices) < 2 or not any(fnmatch.fnmatchcase(node.module_path, g) or
                                       fnmatch.fnmatchcase(node.module_path, g + ".*") for g in self.modules):
            return None
        return megatron_dim(graph, node, len(devices), self.globs, self.split_on)

    def split(self, graph, node, dim: str, devices) -> None:
        split_over_unit(graph, node, dim, len(devices), devices)
        note_split(graph, node, self.split_on)
