"""`parallelize()`: trace, plan and generate on rank 0, share, and load on every rank."""
from __future__ import annotations

import contextlib
import importlib.util
import inspect
import os
import shutil
import sys
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Type, Union

import torch
import torch.distributed as dist

from nnscaler.ir.contracts import CONSTANTS_FILE, GRAPH_FILE, MANIFEST, WEIGHTS_FILE, gencode_file
from nnscaler.ir import policy_name

from .agreement import ArgumentAgreement
from .broadcast import broadcast_files, check_strategy
from .load_check import load_on_every_rank
from ..errors import ConfigError, GenerationError
from .plan_report import report_plan
from .error_display import is_deliberate
from .savedir import savedir_error
from .gen_dir import (ReuseDecision, Identity, ReuseType, decide, generator_identity, instance_dir, read_manifest, staging_dir,
                      state_schema,
                      swap_in, write_manifest)
from .model_sources import collect_sources
from .meta_init import check_initializable, fill_from_init, has_meta_tensors, write_full
from .traced_precision import check_mixed_precision, record_stored_dtypes, trace_precision, traced_in


def parallelize(
    module_or_module_class: Union[torch.nn.Module, Type[torch.nn.Module]],
    dummy_forward_args: Dict[str, Any],
    pas_policy: Union[str, Callable],
    compute_config,
    *,
    gen_savedir: Union[str, os.PathLike] = "./.nnscaler",
    reuse: Union[ReuseType, str] = ReuseType.MATCH,
    instance_name: Optional[str] = None,
    load_module: bool = True,
    module_fn: Optional[Callable[[], torch.nn.Module]] = None,
    init_module_params: bool = True,
    broadcast_strategy: str = "none",
    verbose: bool = False,
):
    """Parallelize a single-device module with a policy and load this rank's part.

    module_or_module_class: an instance (returns a `ParallelModule` instance with the same
        initial weights) or a class (returns the generated `ParallelModule` subclass; its
        ``__init__(init_params=True)`` loads the initial weights saved at generation).
    dummy_forward_args: example arguments of ``forward`` by name, used to trace.
    pas_policy: a built-in policy name (``'dp'``) or a function ``(graph, compute_config) -> graph``.
    compute_config: a `ComputeConfig`.
    gen_savedir / instance_name: where the generated code goes
        (``<gen_savedir>/<module class>/<instance_name or _>/gencode{rank}.py``).
    reuse: a `ReuseType` (or its value) deciding whether earlier generated code is reused;
        ``match`` warns (`SourceChangedWarning`, naming the file) when the model's source files
        changed since generation, ``moo`` regenerates then (docs/tracing.md). A failed generation
        leaves earlier code intact.
    load_module: False only generates (on rank 0) and returns None.
    module_fn: builds the instance to trace when a class is given (default: ``cls()``).
    init_module_params: for an instance, whether to copy its weights into the parallel module.
    broadcast_strategy: ``none``, ``all``, ``no_weights`` or ``code`` (see nnscaler.runtime.driver.broadcast).
    verbose: rank 0 prints the plan report (what each module's ops split, parameters sharded vs
        replicated, collectives per step, ops without an annotation), also when the code is
        reused. The report is always kept in the gen_savedir (``plan_report.json`` / ``.txt``);
        a plan that splits little warns (`nnscaler.runtime.PlanWarning`) either way.

    Deliberate errors (bad input, a refused reuse, a failed trace or plan) are raised with the
    traceback cut at this call, so what is shown is the user's code and the message.

    An error on one rank only (its own arguments) is raised on every rank: the others raise
    `PeerFailedError` naming that rank and its error (runtime/driver/agreement.py).
    """
    agreement = ArgumentAgreement()
    rng_state = torch.get_rng_state()  # a meta-built module is initialized from it (runtime/driver/meta_init.py)
    try:
        return _parallelize(module_or_module_class, dummy_forward_args, pas_policy, compute_config,
                            gen_savedir=gen_savedir, reuse=reuse, instance_name=instance_name,
                            load_module=load_module, module_fn=module_fn,
                            init_module_params=init_module_params, broadcast_strategy=broadcast_strategy,
                            verbose=verbose, agreement=agreement, rng_state=rng_state)
    except Exception as e:
        e = agreement.error_for(e)  # the other ranks learn this rank's error, not gloo's (agreement.py)
        if is_deliberate(e):  # one message; an internal error keeps its traceback (runtime/driver/error_display.py)
            raise e.with_traceback(None) from None
        raise


def _parallelize(module_or_module_class, dummy_forward_args, pas_policy, compute_config, *, gen_savedir,
                 reuse, instance_name, load_module, module_fn, init_module_params, broadcast_strategy,
                 verbose=False, agreement: Optional[ArgumentAgreement] = None, rng_state=None):
    from nnscaler.ir import ComputeConfig

    if not isinstance(compute_config, ComputeConfig):
        raise ConfigError(f"compute_config must be a nnscaler.ComputeConfig, got {type(compute_config).__name__}")
    is_class = isinstance(module_or_module_class, type)
    if is_class and not issubclass(module_or_module_class, torch.nn.Module) or \
            not is_class and not isinstance(module_or_module_class, torch.nn.Module):
        raise TypeError(f"parallelize() needs a torch.nn.Module instance or subclass, got {module_or_module_class!r}")
    if not isinstance(dummy_forward_args, dict):
        raise TypeError("dummy_forward_args must be a dict of forward arguments by name, got "
                        f"{type(dummy_forward_args).__name__}")
    reuse = ReuseType.parse(reuse)
    strategy = check_strategy(broadcast_strategy)
    if not isinstance(gen_savedir, (str, os.PathLike)):
        raise TypeError(f"gen_savedir must be a path, got {type(gen_savedir).__name__}")
    if instance_name is not None and (not isinstance(instance_name, str) or not instance_name
                                      or "/" in instance_name or instance_name in (".", "..")):
        raise ValueError(f"instance_name must be a non-empty name without '/', got {instance_name!r}")
    _check_policy_argument(pas_policy)
    check_mixed_precision(compute_config)  # pas_config['zero3_mixed_precision']: its keys, dtypes, use_zero=3
    on_meta = not is_class and has_meta_tensors(module_or_module_class)
    if on_meta:  # refused here, on every rank, before anything is generated
        check_initializable(module_or_module_class, buffers_only=not init_module_params)

    cls = module_or_module_class if is_class else type(module_or_module_class)
    class_path = f"{cls.__module__}.{cls.__qualname__}"
    directory = instance_dir(gen_savedir, class_path, instance_name).resolve()
    rank, world = _rank_world()
    if rank == 0:  # settings that do nothing (zero_ngroups without use_zero, ...): one warning each
        from nnscaler.ir import warn_ineffective_settings
        warn_ineffective_settings(compute_config)
    if load_module and world != compute_config.runtime_ngpus:
        raise ConfigError(
            f"compute_config.runtime_ngpus is {compute_config.runtime_ngpus} but this job has {world} "
            f"process(es); launch {compute_config.runtime_ngpus} processes (torchrun --nproc_per_node ...) "
            f"and call torch.distributed.init_process_group() first, or pass load_module=False to only generate")

    identity = Identity(class_path, compute_config.to_dict(), policy_name(pas_policy),
                        _input_schema(dummy_forward_args), generator_identity() if rank == 0 else None,
                        state_schema=None if is_class else state_schema(module_or_module_class))
    if agreement is not None:  # every rank's checks are done: one that failed is raised on all (agreement.py)
        agreement.passed()
    error = action = None
    if rank == 0:
        try:
            action = _generate_if_needed(module_or_module_class, module_fn, dummy_forward_args, pas_policy,
                                         compute_config, directory, reuse, identity)
        except Exception as e:  # shared with every rank below, so none of them hangs
            error = savedir_error(e, gen_savedir, directory) or e  # an unusable gen_savedir: one clear line
    _share_outcome(error, rank)
    if rank == 0:  # print (verbose) and warn about what the plan split: nnscaler.runtime.driver.plan_report
        report_plan(directory, verbose, reused=action is ReuseDecision.REUSE)
    transfer_error = broadcast_files(directory, strategy, rank) if world > 1 else None
    # Every rank loads its code and all agree it is rank 0's program before any group is built
    # (one error on every rank, naming the node, instead of a hang): runtime/driver/load_check.py
    gen_cls = load_on_every_rank(directory, rank, strategy, transfer_error, load=load_module)
    if not load_module:
        return None
    if is_class:
        return gen_cls
    with torch.device("meta") if on_meta else contextlib.nullcontext():  # then allocated on the device: only
        pm = gen_cls(init_params=False)  # the local tensors (under use_zero=3 the shards: module.py _post_init)
    if on_meta:  # each rank fills only what it holds: constants, then the initialisation (meta_init.py)
        write_full(pm, _constants(directory))
        fill_from_init(pm, module_or_module_class, rng_state if rng_state is not None else torch.get_rng_state(),
                       buffers_only=not init_module_params)
    elif init_module_params:
        pm.load_full_state(_full_state(module_or_module_class, directory))
        _broadcast_from_first_replica(pm)
    return pm


# -- rank 0: generation -----------------------------------------------------------------------------

def _generate_if_needed(module_or_class, module_fn, dummy_args, pas_policy, cfg, directory: Path,
                        reuse: ReuseType, identity: Identity) -> ReuseDecision:
    action = decide(directory, reuse, identity, module=None if isinstance(module_or_class, type) else module_or_class)
    if action is ReuseDecision.REUSE:
        return action
    try:
        import nnscaler.codegen as codegen
        import nnscaler.policies as policies
    except ModuleNotFoundError as e:
        if e.name not in ("nnscaler.codegen", "nnscaler.policies"):
            raise  # a broken install or a bug, not the missing compile extra: keep the traceback
        raise GenerationError(
            f"code for {identity.module_class} must be generated ({action.value}) but the compile-time "
            f"packages are not installed ({e}); pip install 'nnscaler-runtime[compile]' or provide "
            f"pre-generated code in {directory}") from None
    from nnscaler.ir import IRGraph, trace
    import json

    # Generate into a temporary sibling and swap it in when complete: a failure (trace, policy,
    # codegen, disk) leaves the code that was there intact and reusable (runtime/driver/gen_dir.py).
    staging = staging_dir(directory)
    try:
        if action is ReuseDecision.REUSE_GRAPH:
            for name in (GRAPH_FILE, CONSTANTS_FILE, WEIGHTS_FILE):
                if (directory / name).exists():
                    shutil.copy2(directory / name, staging / name)
            graph = IRGraph.from_json(json.loads((staging / GRAPH_FILE).read_text()))
            sources = (read_manifest(directory) or {}).get("sources")  # unchanged, or it would not reuse
        else:
            module = module_or_class
            if isinstance(module_or_class, type):
                module = module_fn() if module_fn is not None else module_or_class()
            on_meta = has_meta_tensors(module)  # built on the meta device: only a meta trace can run it
            precision = trace_precision(module, cfg)  # use_zero=3's param_dtype: traced in it (traced_precision.py)
            with traced_in(module, precision):
                graph = trace(module, dummy_args, constant_folding=cfg.constant_folding,
                              trace_strategy="meta" if on_meta else cfg.trace_strategy)
            record_stored_dtypes(graph, module, precision)
            _write_json(staging / GRAPH_FILE, graph.to_json())
            _save_tensors(staging / CONSTANTS_FILE,
                          {name: getattr(spec, "tensor", None) for name, spec in graph.constants.items()})
            if not on_meta:  # a meta module has no values: each rank fills its own (meta_init.py, nnscaler.ckpt.load)
                _save_tensors(staging / WEIGHTS_FILE, _module_tensors(module))
            sources = collect_sources(module, graph)
        fingerprint = graph.fingerprint()
        graph = policies.apply_policy(graph, cfg, pas_policy)
        codegen.generate(graph, cfg, staging, policy=identity.policy, fingerprint=fingerprint)
        write_manifest(staging, identity, fingerprint, graph.module_class.rsplit(".", 1)[-1], sources=sources)
        swap_in(staging, directory)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return action


def _write_json(path: Path, data) -> None:
    import json
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def _save_tensors(path: Path, tensors: Dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file
    missing = [n for n, t in tensors.items() if t is None]
    if missing:
        raise GenerationError(f"tensor constant(s) {missing} were traced on the meta device and have no value; "
                              f"register them as buffers of the module or trace with trace_strategy='cpu'")
    tmp = path.with_name(path.name + ".tmp")
    save_file({n: t.detach().to("cpu").contiguous() for n, t in tensors.items()}, str(tmp))
    os.replace(tmp, path)


def _module_tensors(module: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """Full parameters and buffers by canonical name (tied tensors once)."""
    out: Dict[str, torch.Tensor] = {}
    seen = set()
    for name, t in list(module.named_parameters(remove_duplicate=False)) + \
            list(module.named_buffers(remove_duplicate=False)):
        if id(t) in seen:
            continue
        seen.add(id(t))
        out[name] = t
    return out


# -- every rank ---------------------------------------------------------------------------------------

def _share_outcome(error: Optional[BaseException], rank: int) -> None:
    """Raise rank 0's generation error on every rank (with its cause), instead of hanging."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [None]
        if rank == 0 and error is not None:  # an internal error travels with rank 0's traceback
            tb = None if is_deliberate(error) else "".join(traceback.format_exception(error))
            box = [(type(error).__name__, str(error), tb)]
        dist.broadcast_object_list(box, src=0)
        if rank != 0 and box[0] is not None:
            name, message, tb = box[0]
            raise GenerationError(f"rank 0 failed to generate code: {name}: {message}"
                                  + (f"\n\nrank 0's traceback:\n{tb}" if tb else ""))
    if error is not None:
        raise error


def load_generated_class(directory: Path, rank: int, strategy: str = "none"):
    """Import ``gencode{rank}.py`` from `directory` and return its ParallelModule class."""
    manifest = read_manifest(directory)
    path = directory / gencode_file(rank)
    if manifest is None or not path.exists():
        hint = ("every node must see rank 0's gen_savedir (a shared file system), or use "
                "broadcast_strategy='all'") if strategy == "none" else "it should have come from rank 0"
        raise GenerationError(f"generated code for rank {rank} not found in {directory}: {hint}")
    module_name = f"_nnscaler_gen_{abs(hash(str(directory))):x}_rank{rank}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return getattr(module, manifest["class_name"])


def _full_state(module: torch.nn.Module, directory: Path) -> Dict[str, torch.Tensor]:
    return {**_module_tensors(module), **_constants(directory)}


def _constants(directory: Path) -> Dict[str, torch.Tensor]:
    """The graph's tensor constants saved at generation."""
    constants = directory / CONSTANTS_FILE
    if not constants.exists():
        return {}
    from safetensors.torch import load_file
    return load_file(str(constants))


def _broadcast_from_first_replica(pm) -> None:
    """Make replicas identical to the first rank of their sync group (as DDP does)."""
    grid = pm.grid
    if len(grid.sync_ranks) <= 1:
        return
    with torch.no_grad():
        for t in list(pm.parameters()) + list(pm.buffers()):
            dist.broadcast(t.data, src=grid.sync_ranks[0], group=grid.sync_group)


def _rank_world():
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _check_policy_argument(policy) -> None:
    """The argument's shape only: parallelize runs pre-generated code without nnscaler.policies
    (the compile extra), so a name is validated and resolved there (`policies.resolve_policy`,
    through `apply_policy`) when code is generated."""
    if callable(policy):
        try:
            inspect.signature(policy).bind(None, None)
        except TypeError:
            raise TypeError(f"pas_policy {policy!r} must take (graph, compute_config)") from None
    elif not isinstance(policy, str):
        raise TypeError(f"pas_policy must be a policy name or a function (graph, compute_config) -> graph, "
                        f"got {type(policy).__name__}")


def _input_schema(args: Dict[str, Any]) -> dict:
    def describe(obj):
        if isinstance(obj, torch.Tensor):
            return {"tensor": list(obj.shape), "dtype": str(obj.dtype)}
        if isinstance(obj, dict):
            return {str(k): describe(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [describe(v) for v in obj]
        if obj is None or isinstance(obj, (bool, int, float, str)):
            return obj
        return repr(type(obj))
    return {k: describe(v) for k, v in args.items()}
