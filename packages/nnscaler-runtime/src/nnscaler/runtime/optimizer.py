"""build_optimizer: an ordinary torch optimizer over a parallelized module, plus the few
operations that need to know about ranks (global gradient norm, gradient scaling).

The returned optimizer is an instance of a subclass of the optimizer's own class (so
`isinstance(opt, torch.optim.Adam)` still holds) that adds `clip_gnorm`, `scale_grads` and
`sync_shard_grad`; what nnscaler keeps about it (the module, the grid, the ZeRO engine, ...) is
`optimizer_state(opt)` (`nnscaler.runtime.optimizer_state`), nothing stamped on the object.

The gradient norm counts every full gradient element once. Replicas across data-parallel units
hold identical (already averaged) gradients, so only the ranks of one unit contribute: each
rank sums the squares of its local gradients, each divided by the number of plan devices in the
unit that hold the same tensor (`FullMapEntry.replicas`, 1 when the tensor lives on one plan
device), and the sums are all-reduced over the unit group.

A module that is not itself a ParallelModule but contains some keeps its ordinary parameters
replicated on every rank; their gradients are averaged over all ranks by an extra Reducer that
`build_optimizer` keeps in `module_state(module).plain_reducer`, so they count
`plan_ngpus` times per unit in the norm and are weighted accordingly.

With `ComputeConfig(use_zero=True)` (every ParallelModule in the module must agree on `use_zero`,
`zero_ngroups` and `zero_use_reduce_scatter`) the optimizer is built over this rank's owned
shards instead of the parameters (ZeRO stage 1, see `nnscaler.runtime.zero`): `step()` sets the
shard gradients if not done yet, steps, and all-gathers the parameters; `zero_grad()`
clears the parameters' gradients too; `clip_gnorm` / `scale_grads` act on the shard gradients;
`opt.zero_layout` is the public `ZeroShardLayout` (None without ZeRO). ``use_zero=3``: see
`nnscaler.runtime.zero3_optimizer`.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from . import failures
from .errors import ConfigError, NnScalerError
from .grid import RankGrid
from nnscaler.ir.contracts import FullMapEntry, OptimizerAttrs

from .class_mixin import mix_into
from .module import ParallelModule
from .moe import after_optimizer_step
from .reducer import DEFAULT_BUCKET_CAP_MB, Reducer
from .zero import ZeroEngine, ZeroParam, ZeroShardLayout, make_zero_groups
from .zero3_optimizer import FullyShardedOptimizerState
from .optimizer_state import module_state, optimizer_state

__all__ = ["build_optimizer", "NnScalerOptimizerMixin", "plain_trainables"]



class NnScalerOptimizerMixin(OptimizerAttrs):
    """The methods build_optimizer adds to the optimizer's class (its state: `optimizer_state`);
    `zero_layout` is the IR contract `OptimizerAttrs`'s, which the checkpoint package reads."""

    @property
    def zero_layout(self) -> Optional[ZeroShardLayout]:
        """The ZeRO sharding metadata of this rank (`nnscaler.runtime.zero.ZeroShardLayout`), or
        None without ZeRO."""
        zero = _zero(self)
        return zero.layout if zero is not None else None

    def step(self, closure=None):
        """The optimizer's step; under ZeRO it first sets the shard gradients (if not done yet in
        this step) and afterwards all-gathers the updated parameters (collective). Then moves the
        experts' balancing biases (`nnscaler.runtime.moe.balance_experts`) and ends the step of their load
        record (`nnscaler.runtime.moe.expert_load`)."""
        zero = _zero(self)
        if zero is None:
            loss = super().step(closure)
        else:
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            zero.sync_grads()
            super().step()
            zero.gather_params(self)
        state = optimizer_state(self)
        if state is not None:  # experts: the balancing biases, the end of the load record's step
            after_optimizer_step(state.module)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        zero = _zero(self)
        if zero is not None:  # the optimizer holds the shards: clear the parameters' too
            zero.zero_grad(set_to_none)

    def clip_gnorm(self, max_norm: Optional[float] = None) -> torch.Tensor:
        """The global L2 norm of all gradients (a 0-d tensor); when `max_norm` is given, scales
        every gradient by min(1, max_norm / (norm + 1e-6)) like `torch.nn.utils.clip_grad_norm_`.
        Collective over the unit group when plan_ngpus > 1; under ZeRO over the units of the zero
        group, on the shard gradients (after `sync_shard_grad`)."""
        state = optimizer_state(self)
        grid, zero = state.grid, state.zero
        if zero is not None:
            zero.sync_grads()
            group = zero.groups.norm_group
        else:
            group = grid.unit_group if grid.plan_ngpus > 1 else None
        params = [p for group_ in self.param_groups for p in group_["params"] if p.grad is not None]
        device = params[0].grad.device if params else _device_of(self)
        # Summed in float64 on every rank (one scalar: the all-reduce's dtype must not depend on
        # what a rank holds): a float32 sum put float64 training's clip 1e-7 off one process.
        squares = torch.zeros((), dtype=torch.float64, device=device)
        by_replicas: Dict[int, List[torch.Tensor]] = {}
        for p in params:
            by_replicas.setdefault(state.replicas.get(id(p), 1), []).append(p.grad)
        for replicas, grads in by_replicas.items():
            norms = torch._foreach_norm(grads)
            total = torch.stack([n.to(device=device, dtype=torch.float64) for n in norms]).square().sum()
            squares = squares + (total / replicas if replicas != 1 else total)
        if group is not None:
            failures.run(dist.all_reduce, squares, group=group, what="the gradient-norm all-reduce")
        wide = any(p.grad.dtype == torch.float64 for p in params)
        total_norm = squares.sqrt().to(torch.float64 if wide else torch.float32)
        if max_norm is not None:
            coef = (max_norm / (total_norm + 1e-6)).clamp(max=1.0)
            for grads in _by_device([p.grad for p in params]).values():
                torch._foreach_mul_(grads, coef.to(grads[0].device))
        return total_norm

    def scale_grads(self, factor: float) -> None:
        """Multiply every gradient by `factor` (e.g. 1 / number of accumulated micro-batches);
        under ZeRO the shard gradients (after `sync_shard_grad`)."""
        zero = _zero(self)
        if zero is not None:
            zero.sync_grads()
        held = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        for grads in _by_device(held).values():
            torch._foreach_mul_(grads, factor)

    def sync_grads(self) -> None:
        """Synchronise the gradients accumulated locally under ``sync_grad_when(False)`` now: the
        data-parallel reducer of every ParallelModule this optimizer was built over and the one of
        their plain neighbours' parameters (COLLECTIVE over their groups). For a hook that must see
        the local gradients before they are synced (the Trainer's ``before_sync_grad``)."""
        module = optimizer_state(self).module
        for pm in [m for m in module.modules() if isinstance(m, ParallelModule)]:
            if pm.reducer is not None:
                pm.reducer.sync_grads()
        plain = module_state(module)
        if plain is not None and plain.plain_reducer is not None:
            plain.plain_reducer.sync_grads()

    def sync_shard_grad(self) -> None:
        """Under ZeRO: set the shard gradients the optimizer steps on, once per step (with
        zero_use_reduce_scatter this is the reduce-scatter: COLLECTIVE). Called by `clip_gnorm`,
        `scale_grads` and `step`. No-op without ZeRO."""
        zero = _zero(self)
        if zero is not None:
            zero.sync_grads()


def _zero(optimizer) -> Any:
    state = optimizer_state(optimizer)
    return state.zero if state is not None else None


# The base class's step (already wrapped by torch) runs the step hooks; keep torch from wrapping
# this one too when it re-patches (Optimizer.__setstate__, e.g. in load_state_dict).
NnScalerOptimizerMixin.step.hooked = True


def _device_of(optimizer: torch.optim.Optimizer) -> torch.device:
    for group in optimizer.param_groups:
        for p in group["params"]:
            return p.device
    return torch.device("cpu")


def _whole(name: str, p: torch.Tensor, replicas: int) -> FullMapEntry:
    """The full-map entry of a tensor that is its own full tensor."""
    return FullMapEntry(name, name, tuple(p.shape), tuple((0, d) for d in p.shape), (0, 1), replicas)


def _by_device(tensors: List[torch.Tensor]) -> Dict[Any, List[torch.Tensor]]:
    groups: Dict[Any, List[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return groups


def build_optimizer(module: torch.nn.Module, optimizer_fn: Callable[..., torch.optim.Optimizer],
                    **kwargs) -> torch.optim.Optimizer:
    """`optimizer_fn(params, **kwargs)` over the trainable parameters of `module`, extended
    with `clip_gnorm`, `scale_grads` and `sync_shard_grad` (its state: `optimizer_state(opt)`).

    `module` is a ParallelModule, or any module containing ParallelModules (then all its
    trainable parameters are optimized; see the module docstring for the ordinary ones).
    """
    if not callable(optimizer_fn):
        raise TypeError(f"build_optimizer: optimizer_fn must be an optimizer class or a factory called as "
                        f"optimizer_fn(params, **kwargs), got {type(optimizer_fn).__name__} {optimizer_fn!r}")
    pms = [m for m in module.modules() if isinstance(m, ParallelModule)] \
        if isinstance(module, torch.nn.Module) else []
    if not pms:
        raise TypeError(f"build_optimizer: {type(module).__name__} is not a ParallelModule and contains none: "
                        f"parallelize the model first (nnscaler.parallelize) and pass its result")
    grids = {id(pm.grid): pm.grid for pm in pms}
    if len(grids) > 1:
        raise ConfigError("build_optimizer: all parallelized modules must use the same plan_ngpus and "
                          f"runtime_ngpus, got {sorted({(g.plan_ngpus, g.runtime_ngpus) for g in grids.values()})}")
    grid = pms[0].grid
    replicas: Dict[int, int] = {}
    for pm in pms:
        for name, p in pm.named_parameters():
            entry = pm.fullmap.get(name)
            replicas[id(p)] = entry.replicas if entry is not None else 1
    params = [p for p in module.parameters() if p.requires_grad]
    if not params and all(pm.PIPELINE is None for pm in pms):  # every rank holds every parameter: none trains
        _refuse_nothing_to_train(module)
    ordinary = [p for p in params if id(p) not in replicas]
    for p in ordinary:
        replicas[id(p)] = grid.plan_ngpus
    mstate = module_state(module, create=True)
    if ordinary and grid.world_size > 1 and mstate.plain_reducer is None:
        mstate.plain_reducer = Reducer(ordinary, group=grid.group(range(grid.world_size)),
                                       bucket_cap_mb=pms[0].compute_config.reducer_bucket_cap_mb,
                                       async_op=pms[0].compute_config.use_async_reducer)
    zero = _zero_engine(module, pms, params, replicas, grid)
    opt_params = zero.optimizer_params() if zero is not None else params
    # A rank can hold no trainable parameter (a pipeline stage of frozen layers, a ZeRO shard of
    # nothing): it still takes part in every collective of the step, with an empty group.
    optimizer = optimizer_fn(opt_params if len(opt_params) else [{"params": []}], **kwargs)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"build_optimizer: optimizer_fn returned {type(optimizer).__name__}, "
                        f"not a torch.optim.Optimizer")
    if zero is not None:
        zero.bind(optimizer)
    mix_into(optimizer, NnScalerOptimizerMixin, "NnScaler")
    state = optimizer_state(optimizer, create=True)
    state.module, state.grid, state.replicas, state.zero = module, grid, replicas, zero
    return optimizer


def plain_trainables(module: torch.nn.Module) -> List[str]:
    """Names of `module`'s trainable parameters outside its ParallelModules (what use_zero=3 cannot
    shard: refused by build_optimizer, and by the Trainer in its own terms)."""
    held = {id(p) for pm in module.modules() if isinstance(pm, ParallelModule) for p in pm.parameters()}
    return [name for name, p in module.named_parameters() if p.requires_grad and id(p) not in held]


def _fully_sharded(module: torch.nn.Module, pms: List[ParallelModule], params: List[torch.nn.Parameter],
                   replicas: Dict[int, int]) -> Optional[FullyShardedOptimizerState]:
    """use_zero=3: the optimizer over the units' shards (`nnscaler.runtime.zero3_optimizer`)."""
    plain = plain_trainables(module)
    if plain:
        raise ConfigError(f"build_optimizer with use_zero=3: {type(module).__name__} has trainable parameters outside "
                          f"its parallelized modules ({', '.join(plain[:4])}{', ...' if len(plain) > 4 else ''}), "
                          f"which use_zero=3 does not shard: parallelize the whole model (put them inside the "
                          f"module given to parallelize), freeze them, or use use_zero=True")
    paths = {id(m): name for name, m in module.named_modules()}
    sharded = [(paths.get(id(pm), ""), pm) for pm in pms if pm.fully_sharded is not None]
    if not sharded:  # inference_only modules: nothing to optimize
        return None
    state = FullyShardedOptimizerState(sharded)
    for piece in state.pieces:  # gradient-norm weights of the tensors the optimizer holds
        replicas[id(piece.tensor)] = piece.entry.replicas
    return state


def _refuse_nothing_to_train(module: torch.nn.Module) -> None:
    """build_optimizer on a model without trainable parameters is refused: the optimizer would
    update nothing. Not checked for a pipelined module: one stage may hold only frozen
    layers while another trains."""
    frozen = sum(1 for _ in module.parameters())
    what = (f"all its {frozen} parameter tensor(s) have requires_grad=False" if frozen
            else "it has no parameters")
    raise NnScalerError(f"build_optimizer: {type(module).__name__} has no trainable parameters ({what}), so the "
                        f"optimizer would update nothing. Set requires_grad=True on the parameters to train before "
                        f"parallelize() (the generated module keeps each parameter's flag), or do not build an "
                        f"optimizer for a module that only runs forward")


def _zero_engine(module: torch.nn.Module, pms: List[ParallelModule], params: List[torch.nn.Parameter],
                 replicas: Dict[int, int], grid: RankGrid) -> Optional[ZeroEngine]:
    """The ZeRO engine when the ParallelModules ask for it (None otherwise)."""
    keys = ("use_zero", "zero_ngroups", "zero_use_reduce_scatter")
    settings = {tuple(getattr(pm.compute_config, k) for k in keys) for pm in pms}
    if len(settings) > 1:
        raise ConfigError("build_optimizer: all parallelized modules must use the same use_zero, zero_ngroups and "
                          f"zero_use_reduce_scatter, got {sorted(settings)}: regenerate them with one ComputeConfig")
    use_zero, ngroups, reduce_scatter = settings.pop()
    if not use_zero:
        return None
    if pms[0].compute_config.zero_stage == 3:
        return _fully_sharded(module, pms, params, replicas)
    groups = make_zero_groups(grid, ngroups)  # collective: before any other decision that could differ
    paths = {id(m): name for name, m in module.named_modules()}
    entries: List[ZeroParam] = []
    seen = set()
    for pm in pms:
        if reduce_scatter and pm.reducer is not None:  # ZeRO reduce-scatters these gradients instead
            pm.reducer.remove()
            pm.reducer = None
        # tensors held by several pipeline devices keep their own reducer (it sums over the holders
        # too): their gradients arrive averaged, ZeRO only copies the owned ranges
        shared = pm.pipeline_grads.shared_parameters() if pm.pipeline_grads is not None else set()
        for name, p in pm.named_parameters():
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            entry = pm.fullmap.get(name) or _whole(name, p, 1)
            entries.append(ZeroParam(p, paths.get(id(pm), ""), True, entry,
                                     reduce=reduce_scatter and id(p) not in shared))
    names: Dict[int, str] = {}
    for name, p in module.named_parameters():
        names.setdefault(id(p), name)
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            name = names[id(p)]
            entries.append(ZeroParam(p, "", False, _whole(name, p, replicas[id(p)])))
    cap = pms[0].compute_config.reducer_bucket_cap_mb
    engine = ZeroEngine(entries, groups, bucket_cap_mb=DEFAULT_BUCKET_CAP_MB if cap is None else cap)
    for piece in engine.pieces:  # gradient-norm weights of the tensors the optimizer holds
        replicas[id(piece.tensor)] = piece.param.entry.replicas
    return engine
