"""Hooks: the `TrainHook` class and the chain the Trainer calls.

Order (docs/trainer.md): the model, the optimizer and the LR scheduler when they are TrainHooks, then
the hook of ``TrainerArgs.hook`` (a `HookConfig` class or a `HookMapConfig` of functions).
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Dict, Iterator, List

from .config.components import HookMapConfig
from .config.values import resolve_object

__all__ = ["TrainHook", "HookMap", "HookChain", "HOOK_NAMES"]


class TrainHook:
    """Override the methods you need; each is a no-op here. ``trainer`` is the running Trainer."""

    def after_setup(self, trainer) -> None: ...
    def on_finalize(self, trainer) -> None: ...
    def on_train_start(self, trainer) -> None: ...
    def on_train_end(self, trainer) -> None: ...
    def on_val_start(self, trainer) -> None: ...
    def on_val_end(self, trainer, val_loss: float) -> None: ...
    def on_epoch_start(self, trainer, epoch: int) -> None: ...
    def on_epoch_end(self, trainer, epoch: int) -> None: ...
    def on_train_step_start(self, trainer, batches: List[Any]) -> None: ...
    def on_train_step_end(self, trainer, outputs: List[Any]) -> None: ...
    def on_val_step_start(self, trainer, batches: List[Any]) -> None: ...
    def on_val_step_end(self, trainer, outputs: List[Any]) -> None: ...
    def on_step_start(self, trainer, epoch: int, idx: int) -> None: ...
    def on_step_end(self, trainer, epoch: int, idx: int, step_metrics, aggregated_outputs) -> None: ...
    def after_aggregate_train_step_outputs(self, trainer, aggregated_outputs, train_loss: float) -> None: ...
    def after_aggregate_val_step_outputs(self, trainer, aggregated_outputs, val_loss: float) -> None: ...
    def before_zero_grad(self, trainer) -> None: ...
    def after_zero_grad(self, trainer) -> None: ...
    def before_sync_grad(self, trainer) -> None: ...
    def after_sync_grad(self, trainer) -> None: ...
    def before_gnorm_clip(self, trainer) -> None: ...
    def after_gnorm_clip(self, trainer, gnorm) -> None: ...
    def before_optimizer_step(self, trainer) -> None: ...
    def after_optimizer_step(self, trainer) -> None: ...
    def before_log_train_metrics(self, trainer, step_metrics, aggregated_outputs) -> None: ...
    def before_log_val_metrics(self, trainer, metrics) -> None: ...
    def on_load_checkpoint(self, trainer, checkpoint: Dict[str, Any]) -> None: ...
    def on_save_checkpoint(self, trainer, checkpoint: Dict[str, Any]) -> None: ...


HOOK_NAMES = tuple(f.name for f in dataclasses.fields(HookMapConfig))
assert set(HOOK_NAMES) == {n for n in vars(TrainHook) if not n.startswith("_")}


class HookMap(TrainHook):
    """A TrainHook whose methods are the functions named by a HookMapConfig."""

    def __init__(self, config: HookMapConfig):
        for name in HOOK_NAMES:
            fn_name = getattr(config, name)
            if fn_name is not None:
                setattr(self, name, resolve_object(fn_name, f"hook.{name}"))


class HookChain:
    """Calls a hook name on every member in order; ``chain.on_epoch_start(trainer, epoch)``."""

    def __init__(self, hooks: List[TrainHook]):
        self.hooks = hooks

    def defines(self, name: str) -> bool:
        """Whether any member overrides `name` (e.g. to skip work only a hook needs)."""
        for hook in self.hooks:
            if isinstance(hook, HookMap):
                if name in vars(hook):
                    return True
            else:
                fn = getattr(type(hook), name, None)
                if fn is not None and fn is not getattr(TrainHook, name):
                    return True
        return False

    @contextlib.contextmanager
    def around(self, name: str, trainer) -> Iterator[None]:
        """``before_<name>(trainer)``, the body, ``after_<name>(trainer)`` (not after an error)."""
        getattr(self, f"before_{name}")(trainer)
        yield
        getattr(self, f"after_{name}")(trainer)

    def __getattr__(self, name: str) -> Callable[..., None]:
        if name not in HOOK_NAMES:
            raise AttributeError(name)

        def call(*args: Any, **kwargs: Any) -> None:
            for hook in self.hooks:
                fn = getattr(hook, name, None)
                if fn is not None:
                    fn(*args, **kwargs)
        return call
