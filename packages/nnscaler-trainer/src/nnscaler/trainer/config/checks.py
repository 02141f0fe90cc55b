"""Whole-config validation of TrainerArgs, run before any worker process starts.

Every rule a config must follow, each a `TrainerConfigError` naming the key path and the fix.
Dotted names are imported here, so a typo fails at once on the launching machine, not in N
workers.
"""
from __future__ import annotations

import dataclasses
import difflib
import inspect
import typing
import warnings
from typing import Any, Dict, Iterable, Tuple

from ..errors import TrainerConfigError, TrainerConfigWarning
from .components import HookConfig, HookMapConfig
from .values import TYPE_KEY, VALUE_TYPE_KEY, guess_value, resolve_object

__all__ = ["validate", "AUTO_SAMPLER_ARGS", "AUTO_DATALOADER_ARGS", "ignored_args", "RUN_MODES", "REUSE_VALUES",
           "BROADCAST_STRATEGIES"]

RUN_MODES = ("run", "compile")
REUSE_VALUES = ("auto", "match", "override", "moo", "graph")
BROADCAST_STRATEGIES = ("none", "all", "no_weights", "code")

AUTO_SAMPLER_ARGS = ("dataset", "num_replicas", "rank")
AUTO_DATALOADER_ARGS = ("dataset", "batch_size", "sampler")


def _one_of(key: str, value: Any, allowed: Iterable[str]) -> None:
    allowed = tuple(allowed)
    if value not in allowed:
        raise TrainerConfigError(key, f"must be one of {', '.join(map(repr, allowed))}, got {value!r}")


def _positive(key: str, value: Any, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise TrainerConfigError(key, f"must be a positive integer, got {value!r}")


def _importable(key: str, name: Any, required: bool = False, what: str = "") -> None:
    if name is None:
        if required:
            raise TrainerConfigError(key, f"is required: the fully qualified name of {what}")
        return
    resolve_object(name, key)


def ignored_args(args: Dict[str, Any], auto: Tuple[str, ...]) -> list:
    return [k for k in auto if k in (args or {})]


def _int_or_one(value) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 1


def validate(args) -> None:
    """Raise TrainerConfigError for the first rule `args` (TrainerArgs) breaks."""
    cc = args.compute_config
    if cc is None:
        raise TrainerConfigError("compute_config", "is required: set at least compute_config.plan_ngpus, "
                                                   "compute_config.runtime_ngpus and compute_config.use_end2end: true")
    if not cc.use_end2end:
        raise TrainerConfigError("compute_config.use_end2end", "the Trainer runs end2end modules only (forward takes "
                                                               "the batch and returns the loss first): set it to true")
    _one_of("run_mode", args.run_mode, RUN_MODES)
    _one_of("gen_reuse", args.gen_reuse, REUSE_VALUES)
    _one_of("broadcast_strategy", args.broadcast_strategy, BROADCAST_STRATEGIES)
    policy = _check_policy("pas_policy", args.pas_policy)
    _check_precision("precision", args.precision)
    _check_batches(args)
    nmicros = args.compute_config.pas_config.get("pipeline_nmicros")
    pipelined = policy.whole_model or _int_or_one(args.compute_config.pas_config.get("pp_size")) > 1
    if policy.pipelines and nmicros is None and pipelined:  # a pipeline runs the step's micro-batches
        args.compute_config.pas_config["pipeline_nmicros"] = args.update_freq
    elif policy.pipelines and nmicros is not None and nmicros != args.update_freq:
        raise TrainerConfigError("compute_config.pas_config.pipeline_nmicros",
                                 f"is {nmicros} but a step has {args.update_freq} micro-batches per rank "
                                 f"(grad_accumulation_steps); make them equal")
    if args.seed is None and args.init_env_fn is None:
        raise TrainerConfigError("seed", "set seed (an integer, the same on every rank: it fixes the initial weights) "
                                         "or init_env_fn (a function that seeds the run)")
    if args.max_epochs is None and args.max_train_steps is None:
        raise TrainerConfigError("max_epochs", "set max_epochs or max_train_steps (or both): without either the "
                                               "run never ends")
    for name in ("max_epochs", "max_train_steps", "max_val_steps", "val_every_n_train_steps",
                 "val_every_n_epochs"):
        _positive(name, getattr(args, name))
    timeout = args.collective_timeout
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise TrainerConfigError("collective_timeout", f"must be a positive number of seconds, got {timeout!r}")
    _importable("init_env_fn", args.init_env_fn)
    _check_model(args)
    _check_optimizer(args.optimizer)
    _importable("dataset.type", args.dataset.type, required=args.run_mode == "run", what="the dataset class")
    _own_rules(args, args.dataset.type, "dataset.type")  # e.g. hf.TokenizedText's block_size under cp
    _importable("dataloader.type", args.dataloader.type, required=True, what="the dataloader class")
    _importable("dataset_sampler.type", args.dataset_sampler.type, required=True, what="the sampler class")
    _warn_ignored(args)
    if args.lr_scheduler is not None:
        _importable("lr_scheduler.type", args.lr_scheduler.type, required=True, what="the LR scheduler")
        _one_of("lr_scheduler.interval", args.lr_scheduler.interval, ("epoch", "step"))
    _check_checkpoint(args.checkpoint)
    for i, log in enumerate(args.log):
        _importable(f"log.{i}.type", log.type, required=True,
                    what="the logger (e.g. nnscaler.trainer.TensorBoardLogger)")
    _check_hook(args.hook)


def _check_policy(key: str, policy: Any):
    """The policy's `PolicyInfo` (nnscaler.policies.resolve_policy: names and capabilities)."""
    from nnscaler.policies import UnknownPolicyError, resolve_policy
    try:
        return resolve_policy(policy)
    except UnknownPolicyError as e:
        raise TrainerConfigError(key, f"unknown policy {policy!r}; use one of {', '.join(e.known)} "
                                      f"or the fully qualified name of a policy function") from None
    except (ValueError, TypeError) as e:
        raise TrainerConfigError(key, str(e)) from None


def _check_precision(key: str, precision: Any) -> None:
    from nnscaler.ir import ConfigError
    from nnscaler.runtime import parse_precision
    try:
        parse_precision(precision)
    except ConfigError as e:
        raise TrainerConfigError(key, str(e)) from None


def _check_batches(args) -> None:
    _positive("micro_batch_size", args.micro_batch_size, allow_none=False)
    _positive("global_batch_size", args.global_batch_size)
    _positive("grad_accumulation_steps", args.grad_accumulation_steps)
    mbs, dp = args.micro_batch_size, args.dp_size
    gbs, gas = args.global_batch_size, args.grad_accumulation_steps
    if gbs is None:
        return
    if gas is None:
        if gbs % (mbs * dp):
            raise TrainerConfigError(
                "global_batch_size", f"{gbs} is not a multiple of micro_batch_size ({mbs}) x data-parallel size "
                                     f"({dp}); use a multiple of {mbs * dp}, e.g. {mbs * dp * max(1, gbs // (mbs * dp))}")
    elif gbs != mbs * dp * gas:
        raise TrainerConfigError(
            "global_batch_size", f"{gbs} != micro_batch_size ({mbs}) x data-parallel size ({dp}) x "
                                 f"grad_accumulation_steps ({gas}) = {mbs * dp * gas}; set one of "
                                 f"global_batch_size / grad_accumulation_steps only, or make them agree")


def _own_rules(args, name: Any, key: str) -> None:
    """The class's classmethod ``validate_trainer_args(args)``, when it has one: a model's or a
    dataset's own rules (raising TrainerConfigError), run with the other checks."""
    if not isinstance(name, str):
        return
    check = getattr(resolve_object(name, key), "validate_trainer_args", None)
    if callable(check):
        check(args)


def _check_model(args) -> None:
    model = args.model
    _importable("model.type", model.type, required=True, what="the model class")
    if model.type is not None and isinstance(model.type, str):
        cls = resolve_object(model.type, "model.type")
        if not isinstance(cls, type):
            raise TrainerConfigError("model.type", f"must be a class (an nn.Module subclass), not a factory "
                                                   f"function: {model.type!r}")
        _check_arguments(cls, model.args, "model.args")
        _own_rules(args, model.type, "model.type")  # e.g. hf.CausalLM's config, before any worker
    if args.tracing_from_weights is None and any(pm.tracing_from_weights_prefix for pm in model.parallel_modules):
        i = next(i for i, pm in enumerate(model.parallel_modules) if pm.tracing_from_weights_prefix)
        raise TrainerConfigError(f"model.parallel_modules.{i}.tracing_from_weights_prefix",
                                 "needs the top-level tracing_from_weights to be set")
    seen, zeros = set(), []
    for i, pm in enumerate(model.parallel_modules):
        key = f"model.parallel_modules.{i}"
        _importable(f"{key}.type", pm.type, required=True, what="the sub-module class to parallelize")
        _importable(f"{key}.forward_args_gen_fn", pm.forward_args_gen_fn, required=True,
                    what="a function (trainer_args) -> dict of dummy forward arguments")
        if isinstance(pm.type, str):
            _check_arguments(resolve_object(pm.type, f"{key}.type"), pm.args, f"{key}.args")
        if pm.tracing_from_weights and pm.tracing_from_weights_prefix:
            raise TrainerConfigError(f"{key}.tracing_from_weights_prefix",
                                     "set tracing_from_weights or tracing_from_weights_prefix, not both")
        if pm.type in seen:
            raise TrainerConfigError(f"{key}.type", f"{pm.type!r} is parallelized twice; parallelization is per "
                                                    f"module type: subclass it under another name (an alias)")
        seen.add(pm.type)
        policy = _check_policy(f"{key}.pas_policy", pm.pas_policy or args.pas_policy)
        if policy.whole_model:
            raise TrainerConfigError(f"{key}.pas_policy", f"{policy.name!r} makes a pipeline, which needs the whole "
                                                          f"model end to end; parallel_modules cannot be pipelined: "
                                                          f"use dp / tp, or parallelize the whole model")
        _one_of(f"{key}.gen_reuse", pm.gen_reuse or "auto", REUSE_VALUES)
        _one_of(f"{key}.broadcast_strategy", pm.broadcast_strategy or "none", BROADCAST_STRATEGIES)
        _check_precision(f"{key}.precision", pm.precision)
        resolved = args.compute_config
        if pm.compute_config is not None:
            from nnscaler.ir import ConfigError
            try:
                resolved = pm.compute_config.resolve(args.compute_config)
            except ConfigError as e:
                raise TrainerConfigError(f"{key}.compute_config", str(e)) from None
        zero = (resolved.zero_stage, resolved.zero_ngroups, resolved.zero_use_reduce_scatter)
        if zeros and zero != zeros[0][1]:
            names = ("use_zero", "zero_ngroups", "zero_use_reduce_scatter")
            field = next(n for n, a, b in zip(names, zero, zeros[0][1]) if a != b)
            raise TrainerConfigError(f"{key}.compute_config.{field}", f"differs from {zeros[0][0]}'s "
                                     f"({getattr(resolved, field)!r} vs the other's setting): one optimizer shards "
                                     f"every parallelized module alike, so give all parallel_modules the same "
                                     f"use_zero, zero_ngroups and zero_use_reduce_scatter (or set them once in "
                                     f"the top-level compute_config)")
        zeros.append((key, zero))
    _check_contained(model)


def _check_contained(model) -> None:
    """Each ``parallel_modules`` type is the type of a sub-module of the model (what the workers
    replace), seen on a model built on the meta device (no memory, no weights); a model that cannot
    be built there is left to the workers' check."""
    if not model.parallel_modules or not isinstance(model.type, str):
        return
    import torch
    from .values import build_args
    try:
        with torch.device("meta"):
            built = resolve_object(model.type, "model.type")(**build_args(model.args, "model.args"))
        types = {type(m) for m in built.modules()}
    except Exception:
        return
    for i, pm in enumerate(model.parallel_modules):
        cls = resolve_object(pm.type, f"model.parallel_modules.{i}.type")
        if cls not in types:
            names = sorted({t.__name__ for t in types} - {type(built).__name__})
            raise TrainerConfigError(f"model.parallel_modules.{i}.type",
                                     f"{model.type} has no sub-module of type {pm.type!r} (its sub-module types: "
                                     f"{', '.join(names) or 'none'}); name one of them, by its fully qualified name")


def _check_arguments(cls: Any, raw: Any, key: str) -> None:
    """The config's arguments of ``cls(**args)`` against the signature of ``cls``: an unknown name
    (naming the closest valid one), a missing required one, or a plain value whose type contradicts
    the annotation (int / float / bool / str, Optional and Union of them) is refused here, before
    any worker starts. A ``**kwargs`` parameter accepts any name; values built from ``__type`` /
    ``__value_type`` and annotations of other types are not checked."""
    if not isinstance(raw, dict):
        return  # build_args names the key when the workers build it
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):  # a builtin without a signature
        return
    params = {n: p for n, p in signature.parameters.items()
              if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    open_names = any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values())
    name = getattr(cls, "__qualname__", repr(cls))
    if not open_names:
        for arg in raw:
            if arg not in params:
                close = difflib.get_close_matches(str(arg), list(params), n=1)
                hint = f"did you mean {close[0]!r}? " if close else ""
                raise TrainerConfigError(f"{key}.{arg}", f"{name} has no argument {arg!r}; {hint}its arguments are "
                                                         f"{', '.join(params) or 'none'}")
    missing = [n for n, p in params.items() if p.default is p.empty and n not in raw]
    if missing:
        raise TrainerConfigError(key, f"{name} needs the argument{'s' if len(missing) > 1 else ''} "
                                      f"{', '.join(missing)}: set {', '.join(f'{key}.{n}' for n in missing)}")
    try:
        hints = typing.get_type_hints(cls.__init__)
    except Exception:  # an annotation that does not resolve: check the ones that are types already
        hints = {n: p.annotation for n, p in params.items() if not isinstance(p.annotation, str)}
    for arg, value in raw.items():
        if arg not in params or arg not in hints:
            continue
        if isinstance(value, dict) and (TYPE_KEY in value or VALUE_TYPE_KEY in value):
            continue
        if isinstance(value, str):
            value = guess_value(value)
        allowed = _plain_types(hints[arg])
        if allowed is None or (value is None and params[arg].default is None):
            continue
        if not any(_is_a(value, t) for t in allowed):
            expected = " or ".join("None" if t is type(None) else t.__name__ for t in allowed)
            raise TrainerConfigError(f"{key}.{arg}", f"{name} expects {expected} for {arg!r} (its annotation), "
                                                     f"got {value!r}; give a value of that type")


_PLAIN = (bool, int, float, str, type(None))


def _plain_types(annotation: Any):
    """The plain types an annotation allows (a tuple), None when it allows anything else too."""
    if annotation in _PLAIN:
        return (annotation,)
    if typing.get_origin(annotation) is typing.Union or type(annotation).__name__ == "UnionType":
        members = typing.get_args(annotation)
        if all(m in _PLAIN for m in members):
            return tuple(members)
    return None


def _is_a(value: Any, kind: type) -> bool:
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


def _check_optimizer(opt) -> None:
    _importable("optimizer.type", opt.type, required=True, what="the optimizer (e.g. torch.optim.AdamW)")
    _one_of("optimizer.loss_reduction", opt.loss_reduction, ("mean", "sum"))
    _one_of("optimizer.grad_reduction", opt.grad_reduction, ("mean", "sum", "per-token-mean"))
    if opt.grad_reduction == "per-token-mean" and opt.aggregate_outputs_fn is None:
        raise TrainerConfigError("optimizer.aggregate_outputs_fn", "is required with grad_reduction "
                                                                   "'per-token-mean': a function (loss_outputs, "
                                                                   "sync_group) -> AggregatedOutputs with num_tokens")
    _importable("optimizer.aggregate_outputs_fn", opt.aggregate_outputs_fn)
    if opt.clip_gnorm is not None and opt.clip_gnorm < 0:
        raise TrainerConfigError("optimizer.clip_gnorm", f"must be >= 0 (0 or null: no clipping), got {opt.clip_gnorm}")


def _check_checkpoint(ckpt) -> None:
    _one_of("checkpoint.save_type", ckpt.save_type, ("sharded", "deduped"))
    for name in ("every_n_train_steps", "every_n_epochs", "keep_last_n_checkpoints"):
        _positive(f"checkpoint.{name}", getattr(ckpt, name))
    if not isinstance(ckpt.async_save, bool):
        raise TrainerConfigError("checkpoint.async_save", f"expected true or false, got {ckpt.async_save!r}")


def _check_hook(hook) -> None:
    if isinstance(hook, HookConfig):
        _importable("hook.type", hook.type, required=True, what="the hook class (a TrainHook subclass)")
    elif isinstance(hook, HookMapConfig):
        for f in dataclasses.fields(hook):
            _importable(f"hook.{f.name}", getattr(hook, f.name))


def _warn_ignored(args) -> None:
    for section, auto in (("dataset_sampler", AUTO_SAMPLER_ARGS), ("dataloader", AUTO_DATALOADER_ARGS)):
        cfg = getattr(args, section)
        for part in ("train_args", "val_args", "test_args"):
            names = ignored_args(getattr(cfg, part), auto)
            if names:
                warnings.warn(f"{section}.{part}: {', '.join(names)} set by the Trainer; the given value"
                              f"{'s are' if len(names) > 1 else ' is'} ignored", TrainerConfigWarning, stacklevel=3)
