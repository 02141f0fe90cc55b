"""Building a run's components from TrainerArgs: process group, seeds, data, the parallelized
model, the optimizer, the LR scheduler."""
from __future__ import annotations

import inspect
import os
import random
from datetime import timedelta
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from .config.checks import AUTO_DATALOADER_ARGS, AUTO_SAMPLER_ARGS
from .config.values import build_args, instantiate, resolve_object
from .errors import TrainerError
from .state import SkippingSampler
from .val_sampler import ValidationSampler
from .config.components import HookConfig, HookMapConfig
from .hooks import HookMap

__all__ = ["build_config_hooks", "build_loggers", "init_distributed", "seed_everything", "build_dataset", "build_dataloader", "dummy_batch",
           "parallelize_model", "build_trainer_optimizer", "build_lr_scheduler"]


def init_distributed(world_size: int, timeout_s: float = 600) -> bool:
    """Join the process group torchrun describes (if not joined yet), with `timeout_s` seconds as
    its timeout (``collective_timeout``: nnscaler's collectives give up after it); True when this
    call created it (the Trainer then destroys it at the end). One process without torchrun needs none."""
    if dist.is_available() and dist.is_initialized():
        return False
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        if world_size == 1:
            return False
        raise TrainerError(f"compute_config.runtime_ngpus is {world_size} but this process was not started by "
                           f"torchrun: run `nnscaler train --nproc {world_size} -f CONFIG` or "
                           f"`torchrun --nproc_per_node {world_size} -m nnscaler.trainer -f CONFIG`")
    from nnscaler.runtime import default_backend
    timeout = timedelta(seconds=timeout_s)
    store = _restart_store(timeout)
    if store is None:
        dist.init_process_group(default_backend(), timeout=timeout)
    else:
        dist.init_process_group(default_backend(), timeout=timeout, store=store, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]))
    from nnscaler.runtime import failures
    failures.install_excepthook()  # a rank failing before its module is built tells its peers why
    return True


def _restart_store(timeout: timedelta):
    """Under torchrun's agent, a view of its store whose keys belong to this restart alone, or
    None (no agent store: env:// as usual). The agent keeps one store across restarts
    (``--max-restarts``), where the processes of an earlier attempt left their keys (their gloo
    addresses, nnscaler's failure notices): the new processes would read those and connect to
    the dead ones."""
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if restart is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]),
                          is_master=False, timeout=timeout)
    return dist.PrefixStore(f"nnscaler/restart_{restart}/", store)


def seed_everything(seed: int) -> None:
    """The same seed for Python, NumPy and torch on every rank (same initial weights)."""
    random.seed(seed)
    torch.manual_seed(seed)
    np.random.seed(seed % (2 ** 32))


def _without(args: Dict[str, Any], auto: Tuple[str, ...]) -> Dict[str, Any]:
    return {k: v for k, v in args.items() if k not in auto}


def build_dataset(cfg, stage: str):
    """The ``train`` / ``val`` dataset, or None for val when ``dataset.val_args`` is empty."""
    raw = getattr(cfg, f"{stage}_args")
    if stage != "train" and not raw:
        return None
    kind = resolve_object(cfg.type, "dataset.type")
    return instantiate(kind, build_args(raw, f"dataset.{stage}_args"), f"dataset.{stage}_args")


def build_dataloader(args, dataset, stage: str, rank: int, generator: torch.Generator):
    """``DataLoader(dataset, batch_size=micro_batch_size, sampler=Sampler(dataset, num_replicas=dp,
    rank=rank // plan_ngpus, **sampler_args), **loader_args)``; the sampler is wrapped in a
    `SkippingSampler` (resume mid-epoch)."""
    scfg, lcfg = args.dataset_sampler, args.dataloader
    sampler_raw = getattr(scfg, f"{stage}_args") or (scfg.train_args if stage != "train" else {})
    loader_raw = getattr(lcfg, f"{stage}_args") or (lcfg.train_args if stage != "train" else {})
    sampler_kwargs = _without(build_args(sampler_raw, f"dataset_sampler.{stage}_args"), AUTO_SAMPLER_ARGS)
    loader_kwargs = _without(build_args(loader_raw, f"dataloader.{stage}_args"), AUTO_DATALOADER_ARGS)
    plan_ngpus = args.compute_config.plan_ngpus
    sampler_type = resolve_object(scfg.type, "dataset_sampler.type")
    if stage == "val" and sampler_type is torch.utils.data.DistributedSampler:  # the same set for any dp
        sampler = ValidationSampler(dataset, args.dp_size, rank // plan_ngpus, args.micro_batch_size,
                                    args.max_val_steps)
    else:
        sampler = instantiate(sampler_type,
                              dict(sampler_kwargs, dataset=dataset, num_replicas=args.dp_size, rank=rank // plan_ngpus),
                              f"dataset_sampler.{stage}_args")
    loader_type = resolve_object(lcfg.type, "dataloader.type")
    if "generator" not in loader_kwargs and _accepts(loader_type, "generator"):
        loader_kwargs["generator"] = generator  # worker seeds drawn here, not from the global RNG
    sampler = SkippingSampler(sampler)
    loader = instantiate(loader_type, dict(loader_kwargs, dataset=dataset, batch_size=args.micro_batch_size,
                                           sampler=sampler), f"dataloader.{stage}_args")
    return loader, sampler


def _accepts(fn: Any, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def dummy_batch(args, dataset) -> Any:
    """The first micro-batch of the dataset (indices 0..micro_batch_size-1), collated as the
    train dataloader collates, for tracing."""
    lcfg = args.dataloader
    kwargs = _without(build_args(lcfg.train_args, "dataloader.train_args"), AUTO_DATALOADER_ARGS)
    for name in ("num_workers", "persistent_workers", "prefetch_factor", "shuffle", "drop_last",
                 "generator", "worker_init_fn", "pin_memory"):
        kwargs.pop(name, None)
    loader = instantiate(resolve_object(lcfg.type, "dataloader.type"),
                         dict(kwargs, dataset=dataset, batch_size=args.micro_batch_size,
                              sampler=list(range(min(args.micro_batch_size, len(dataset))))), "dataloader.train_args")
    return next(iter(loader))


def first_argument(module_type: type) -> str:
    """The name of forward's first parameter (the data sample of an end2end module)."""
    params = list(inspect.signature(module_type.forward).parameters.values())[1:]
    if not params or params[0].kind not in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD):
        raise TrainerError(f"{module_type.__qualname__}.forward must take the data sample as its first argument "
                           f"(an end2end module: forward(batch) -> loss, ...)")
    return params[0].name


def load_tracing_weights(model: torch.nn.Module, path: str, prefix: Optional[str] = None) -> None:
    """Load the initial weights used for tracing (a safetensors file, a merged checkpoint
    directory, or a torch state-dict file read with weights_only=True)."""
    state = _read_weights(path)
    if prefix:
        state = {k[len(prefix):].lstrip("."): v for k, v in state.items() if k.startswith(prefix)}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing:
        raise TrainerError(f"tracing_from_weights {path!r}{f' (prefix {prefix!r})' if prefix else ''} lacks "
                           f"{len(missing)} weights of the model, e.g. {missing[:3]}")


def _read_weights(path: str) -> Dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    if os.path.isdir(path):
        files = sorted(f for f in os.listdir(path) if f.startswith("model") and f.endswith(".safetensors"))
        if not files:
            raise TrainerError(f"tracing_from_weights {path!r} is a directory without model*.safetensors "
                               f"(a merged checkpoint: `nnscaler ckpt merge SRC DST`)")
        state: Dict[str, torch.Tensor] = {}
        for f in files:
            state.update(load_file(os.path.join(path, f)))
        return state
    if path.endswith(".safetensors"):
        return load_file(path)
    return torch.load(path, map_location="cpu", weights_only=True)


def build_lr_scheduler(args, optimizer):
    """The LR scheduler over `optimizer`, or None."""
    cfg = args.lr_scheduler
    if cfg is None:
        return None
    kind = resolve_object(cfg.type, "lr_scheduler.type")
    return instantiate(kind, build_args(cfg.args, "lr_scheduler.args"), "lr_scheduler.args", optimizer)


def build_trainer_optimizer(args, model, precision):
    """build_optimizer over the model, then the precision plugin's master weights if needed."""
    from nnscaler.runtime import build_optimizer
    _refuse_unsharded_trainables(model)
    kind = resolve_object(args.optimizer.type, "optimizer.type")
    kwargs = build_args(args.optimizer.args, "optimizer.args")
    try:
        optimizer = build_optimizer(model, kind, **kwargs)
    except TypeError as e:
        raise TrainerError(f"optimizer.args: {args.optimizer.type}(params, **{sorted(kwargs)}) failed: {e}") from None
    return precision.setup_optimizer(optimizer)


def _refuse_unsharded_trainables(model: torch.nn.Module) -> None:
    """Under ``use_zero: 3`` every trainable parameter must live in a parallelized module: a
    plain neighbour of ``model.parallel_modules`` would be neither sharded nor optimized alike.
    Refused here with the config keys to change (build_optimizer refuses it too, in its terms)."""
    from nnscaler.runtime import ParallelModule, plain_trainables
    if not any(m.fully_sharded is not None for m in model.modules() if isinstance(m, ParallelModule)):
        return
    plain = plain_trainables(model)
    if plain:
        raise TrainerError(f"compute_config.use_zero: 3 shards only the parameters of parallelized modules, and "
                           f"{type(model).__name__} has trainable parameters outside model.parallel_modules "
                           f"({', '.join(plain[:4])}{', ...' if len(plain) > 4 else ''}): parallelize the whole "
                           f"model (remove model.parallel_modules), freeze them, or use use_zero: true")


def parallelize_model(args, model: torch.nn.Module, dummy: Any, load_module: bool,
                      init_module_params: bool = True) -> Optional[torch.nn.Module]:
    """The whole model parallelized with the trainer's settings (end2end); `init_module_params`
    False for a model built on the meta device whose values are loaded afterwards."""
    from nnscaler.runtime import parallelize
    name = first_argument(type(model))
    return parallelize(model, {name: dummy}, _policy(args.pas_policy), args.compute_config,
                       gen_savedir=args.gen_savedir, reuse=args.resolved_gen_reuse, instance_name=args.instance_name,
                       broadcast_strategy=args.broadcast_strategy, load_module=load_module,
                       init_module_params=init_module_params)


def _policy(policy: Any) -> Any:
    """What parallelize gets: a registered name as is (it is recorded in the manifest), else the
    function (nnscaler.policies.resolve_policy)."""
    from nnscaler.policies import resolve_policy
    info = resolve_policy(policy)
    return info.name if info.builtin else info.function


def parallelize_submodules(args, model: torch.nn.Module, load_module: bool) -> List[str]:
    """Replace every sub-module of each ``model.parallel_modules`` type by its parallelized
    version (one generated class per type, the same initial weights for every occurrence).
    Returns the replaced module paths."""
    from nnscaler.runtime import apply_precision, parallelize
    replaced = []
    for i, cfg in enumerate(args.model.parallel_modules):
        key = f"model.parallel_modules.{i}"
        cls = resolve_object(cfg.type, f"{key}.type")
        gen_args = resolve_object(cfg.forward_args_gen_fn, f"{key}.forward_args_gen_fn")(args)
        kwargs = build_args(cfg.args, f"{key}.args")
        compute_config = cfg.compute_config.resolve(args.compute_config) if cfg.compute_config else args.compute_config
        reuse = cfg.gen_reuse or args.gen_reuse
        if reuse == "auto":
            reuse = "moo" if args.run_mode == "compile" else "match"

        def module_fn(cls=cls, kwargs=kwargs, cfg=cfg):
            module = cls(**kwargs)
            weights = cfg.tracing_from_weights or (args.tracing_from_weights if cfg.tracing_from_weights_prefix else None)
            if weights:
                load_tracing_weights(module, weights, cfg.tracing_from_weights_prefix)
            return module

        pm_class = parallelize(cls, gen_args, _policy(cfg.pas_policy or args.pas_policy), compute_config,
                               gen_savedir=cfg.gen_savedir or args.gen_savedir, reuse=reuse,
                               instance_name=cfg.instance_name or args.instance_name,
                               broadcast_strategy=cfg.broadcast_strategy or args.broadcast_strategy,
                               load_module=load_module, module_fn=module_fn)
        if not load_module:
            continue
        targets = [(name, m) for name, m in model.named_modules() if type(m) is cls]
        if not targets:
            raise TrainerError(f"{key}.type: the model has no sub-module of type {cfg.type!r}")
        for name, _ in targets:
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            pm = pm_class()
            precision = cfg.precision if cfg.precision is not None else args.precision
            if precision is not None:
                apply_precision(pm, precision)
            setattr(parent, attr, pm)
            replaced.append(name)
    return replaced


def build_config_hooks(args) -> List[Any]:
    """The hook of ``TrainerArgs.hook``: a HookMap of functions, an instance of the hook class, or none."""
    hook = args.hook
    if isinstance(hook, HookMapConfig):
        return [HookMap(hook)]
    if isinstance(hook, HookConfig):
        return [instantiate(resolve_object(hook.type, "hook.type"), build_args(hook.args, "hook.args"), "hook.args")]
    return []


def build_loggers(args) -> List[Any]:
    """Rank 0's loggers, set up with the resolved config (each checkpoint keeps its own copy)."""
    loggers = []
    for i, log in enumerate(args.log):
        logger = instantiate(resolve_object(log.type, f"log.{i}.type"), build_args(log.args, f"log.{i}.args"),
                             f"log.{i}.args")
        logger.setup(args.to_dict())
        loggers.append(logger)
    return loggers
