"""What users of Lightning's FSDP strategy pass as strategy arguments, in nnscaler's terms.

- `activation_checkpointing_policy`: a set of module types (as FSDPStrategy's) -> every op of
  those modules is recomputed in backward: the types go to the plan as ``ComputeConfig.pas_config
  ["recompute_modules"]``, which every policy honours (nnscaler.policies.recompute_modules), so
  the generated forward runs them under ``torch.utils.checkpoint``.
- `auto_wrap_policy`: a set of module types (as FSDPStrategy's) -> under ``use_zero=3`` each such
  submodule is one gather unit: ``pas_config["zero3_units"]`` (resolved by code generation).
- `cpu_offload`: optimizer state kept on CPU while training on GPU: the optimizer steps on fp32
  copies on `OFFLOAD_DEVICE` (offload.py, a simplified ZeRO-Offload; with ZeRO, of this rank's
  shards). The same machinery runs on CPU (CPU copies), where it is tested.
- `sharding_strategy`: FSDP's sharding strategies (a name or torch's ``ShardingStrategy``) ->
  ``ComputeConfig.use_zero``: FULL_SHARD -> 3 (parameters, gradients and optimizer state
  sharded), SHARD_GRAD_OP -> True (ZeRO stage 1: optimizer state sharded), NO_SHARD -> False,
  HYBRID_SHARD -> 3 with ``zero_ngroups`` = the number of nodes (sharded within each node,
  replicated across nodes); `sharding_config` applies it at setup.
- `configure_model()`: a model built in the hook on the meta device is never materialized whole:
  `parallelize` traces it on meta and each rank allocates and initializes only what it holds
  (`built_on_meta`; the values equal building it on the CPU); load weights into it with
  ``nnscaler.ckpt.load(path, self)`` in ``on_fit_start`` (a checkpoint or a Hugging Face directory:
  each rank reads only its shards).
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterable, Optional, Set, Type

import torch
from nnscaler.ir import ComputeConfig

from .errors import NnScalerLightningError

__all__ = ["checkpointing_types", "recompute_config", "wrap_config", "check_strategy_args", "check_cpu_offload", "offload_device", "built_on_meta", "example_rng",
           "OFFLOAD_DEVICE", "SHARDING_STRATEGIES", "sharding_strategy_name", "sharding_config"]

OFFLOAD_DEVICE = torch.device("cpu")  # where cpu_offload=True keeps the optimizer's copies and state


def checkpointing_types(policy: Any, argument: str = "activation_checkpointing_policy"
                        ) -> Optional[Set[Type[torch.nn.Module]]]:
    """The module types of ``activation_checkpointing_policy`` (or `argument`, e.g. ``auto_wrap_policy``;
    None: none), checked."""
    if policy is None:
        return None
    if isinstance(policy, type):
        policy = {policy}
    if not isinstance(policy, (set, frozenset, list, tuple)) or not all(
            isinstance(t, type) and issubclass(t, torch.nn.Module) for t in policy):
        raise NnScalerLightningError(
            f"NnScalerStrategy({argument}={policy!r}): give a set of torch.nn.Module types, "
            f"e.g. {{torch.nn.TransformerEncoderLayer}} (wrap policies and callables are not supported)")
    return set(policy)


def _qualified(t: type) -> str:
    return f"{t.__module__}.{t.__qualname__}"


def recompute_config(cfg, types: Optional[Set[type]], module: torch.nn.Module):
    """`cfg` with the submodules of `types` in ``pas_config["recompute_modules"]``."""
    return _types_config(cfg, types, module, "recompute_modules", "activation_checkpointing_policy")


def wrap_config(cfg, types: Optional[Set[type]], module: torch.nn.Module):
    """`cfg` with the submodules of `types` (FSDP's ``auto_wrap_policy``) as use_zero=3's gather units,
    ``pas_config["zero3_units"]`` (resolved by code generation; nothing without use_zero=3)."""
    return _types_config(cfg, types, module, "zero3_units", "auto_wrap_policy")


def _types_config(cfg, types: Optional[Set[type]], module: torch.nn.Module, key: str, argument: str):
    if not types:
        return cfg
    present = {type(m) for name, m in module.named_modules() if name}
    missing = sorted(t.__name__ for t in types if t not in present)
    if missing:
        kinds = sorted({t.__name__ for t in present})
        raise NnScalerLightningError(
            f"NnScalerStrategy({argument}=...): {type(module).__name__} has no submodule of "
            f"type {', '.join(missing)}; its submodule types: {', '.join(kinds) or 'none'}")
    names = sorted(_qualified(t) for t in types)
    pas = dict(cfg.pas_config)
    given = pas.get(key)
    if given:
        names = ([given] if isinstance(given, str) else list(given)) + names
    pas[key] = names
    return dataclasses.replace(cfg, pas_config=pas)


def check_strategy_args(compute_config: Any, state_dict_type: Any, state_dict_hint: str = "") -> None:
    """The arguments both strategies (Lightning's and Fabric's) check alike: a ComputeConfig (or
    None) and a checkpoint kind; `state_dict_hint` ends the kind's message."""
    if compute_config is not None and not isinstance(compute_config, ComputeConfig):
        raise NnScalerLightningError(f"NnScalerStrategy(compute_config=...) must be a nnscaler ComputeConfig, "
                                     f"got {type(compute_config).__name__}")
    if state_dict_type not in ("sharded", "deduped"):
        raise NnScalerLightningError(f"NnScalerStrategy(state_dict_type={state_dict_type!r}): use 'sharded' or "
                                     f"'deduped'{state_dict_hint}")


def check_cpu_offload(cpu_offload: Any) -> None:
    if not isinstance(cpu_offload, bool):
        raise NnScalerLightningError(f"NnScalerStrategy(cpu_offload={cpu_offload!r}): give True or False "
                                     f"(offload policies are not supported)")


def offload_device(cpu_offload: bool) -> Optional[torch.device]:
    """Where the optimizer steps (`rebuild`'s `offload_device`): None without offload."""
    return OFFLOAD_DEVICE if cpu_offload else None


SHARDING_STRATEGIES = {  # FSDP's ShardingStrategy name -> ComputeConfig.use_zero
    "FULL_SHARD": 3, "HYBRID_SHARD": 3, "SHARD_GRAD_OP": True, "NO_SHARD": False}


def sharding_strategy_name(strategy: Any) -> Optional[str]:
    """The FSDP sharding strategy's name (None: not given), from a name (any case) or torch's
    ``ShardingStrategy`` member; checked."""
    if strategy is None:
        return None
    name = getattr(strategy, "name", strategy)
    if isinstance(name, str) and name.upper() in SHARDING_STRATEGIES:
        return name.upper()
    raise NnScalerLightningError(
        f"NnScalerStrategy(sharding_strategy={strategy!r}): give one of {', '.join(SHARDING_STRATEGIES)} (a name or "
        f"torch.distributed.fsdp.ShardingStrategy); _HYBRID_SHARD_ZERO2 has no nnscaler equivalent")


def sharding_config(cfg: ComputeConfig, name: Optional[str], num_nodes: int) -> ComputeConfig:
    """`cfg` with ``use_zero`` (and ``zero_ngroups`` for HYBRID_SHARD) of sharding strategy `name`
    (`SHARDING_STRATEGIES`). A compute_config whose own use_zero / zero_ngroups say otherwise is
    refused, naming both."""
    if name is None:
        return cfg
    want = {"use_zero": SHARDING_STRATEGIES[name]}
    if name == "HYBRID_SHARD":
        want["zero_ngroups"] = num_nodes
    default = ComputeConfig(cfg.plan_ngpus, cfg.runtime_ngpus)
    for field, value in want.items():
        given = getattr(cfg, field)
        if given != getattr(default, field) and (given != value or type(given) is not type(value)):
            raise NnScalerLightningError(
                f"NnScalerStrategy(sharding_strategy={name!r}) means ComputeConfig({field}={value!r}), but "
                f"compute_config has {field}={given!r}: give one of the two (leave {field} unset, or drop "
                f"sharding_strategy)")
    if want["use_zero"] and cfg.dp_size < 2:
        raise NnScalerLightningError(
            f"NnScalerStrategy(sharding_strategy={name!r}) shards over the data-parallel ranks, but the plan has "
            f"one (plan_ngpus {cfg.plan_ngpus} = runtime_ngpus {cfg.runtime_ngpus}): use more devices, a smaller "
            f"plan_ngpus, or NO_SHARD")
    return dataclasses.replace(cfg, **want)


def built_on_meta(module: torch.nn.Module) -> bool:
    """A model built in ``configure_model`` under ``torch.device("meta")``: `parallelize` gives
    each rank only its local tensors and fills them from the model's own initialisation (each
    ``reset_parameters()``, equal to building it on the CPU; runtime/driver/meta_init.py), so the
    whole model is never materialized; the example input is then drawn without touching torch's
    generator (`example_rng`), which the initialisation replays from."""
    return any(t.is_meta for t in module.parameters()) or any(t.is_meta for t in module.buffers())


def example_rng(on_meta: bool):
    """Around making the example input of a meta-built model: torch's generator left as it was."""
    return torch.random.fork_rng(devices=[]) if on_meta else contextlib.nullcontext()
