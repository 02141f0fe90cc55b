"""Every private name of Lightning that nnscaler.lightning uses, and why (no other module of this
package imports one; tests/lightning/test_internals.py checks). Checked against Lightning 2.6.6
and torch 2.13.0 (constraints.txt); a release that renames one fails here, at import, by name.

Lightning's own strategies (`DDPStrategy`, `FSDPStrategy`) are built from these same pieces and
Lightning offers no public equivalent, so a third-party strategy that behaves like them must:

- `_SubprocessScriptLauncher`, `_MultiProcessingLauncher` (Trainer and Fabric flavours): start
  one process per device ("popen" re-runs the script, "spawn" / "fork"), as DDP does.
- `_init_dist_connection`, `_get_default_process_group_backend_for_device`,
  `_distributed_is_initialized`: join the default process group from the cluster environment
  with DDP's backend choice and timeout.
- `_sync_ddp_if_available`: the all-reduce behind `Strategy.reduce` (what `log(sync_dist=True)`
  calls), with DDP's handling of "mean" / "sum" and integer tensors.
- `_init_optimizers_and_lr_schedulers`: the parsing of every form `configure_optimizers` may
  return (optimizer, lists, dicts with "lr_scheduler", monitor and interval settings) into the
  `LRSchedulerConfig`s the Trainer's loops read.
- `_BackwardSyncControl`: Fabric's interface behind `fabric.no_backward_sync` (set as the
  strategy's ``_backward_sync_control``).
- `first_dataloader` reads a loop's ``_data_source``: the tracing input of
  ``dummy_forward_args_fn`` is the first training batch, needed in `Strategy.setup` (before the
  optimizer is rebuilt and a checkpoint restored), while Lightning builds the dataloaders only
  later, when its loops start; the source is the one place that holds a dataloader passed to
  ``trainer.fit(train_dataloaders=...)``.

The strategies also set the members Lightning's base strategy classes read, as Lightning's own
subclasses do (``_launcher``, ``_precision_plugin`` / ``_precision``, ``_num_nodes``,
``_process_group_backend``, ``_timeout``).

What the LightningModule is given is public: `forward` and `log` are rewritten as instance
attributes that shadow the class's methods (model_setup.py), and parameters are read with
`named_parameters`.
"""
from __future__ import annotations

from typing import Any, Optional

from lightning.fabric.strategies.launchers import _MultiProcessingLauncher as FabricSpawnLauncher
from lightning.fabric.strategies.launchers import _SubprocessScriptLauncher as FabricScriptLauncher
from lightning.fabric.strategies.strategy import _BackwardSyncControl as BackwardSyncControl
from lightning.fabric.utilities.distributed import _distributed_is_initialized as distributed_is_initialized
from lightning.fabric.utilities.distributed import (
    _get_default_process_group_backend_for_device as default_process_group_backend)
from lightning.fabric.utilities.distributed import _init_dist_connection as init_dist_connection
from lightning.fabric.utilities.distributed import _sync_ddp_if_available as sync_ddp_if_available
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers as init_optimizers_and_lr_schedulers
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher as TrainerSpawnLauncher
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher as TrainerScriptLauncher

__all__ = ["FabricScriptLauncher", "FabricSpawnLauncher", "TrainerScriptLauncher", "TrainerSpawnLauncher",
           "BackwardSyncControl", "distributed_is_initialized", "default_process_group_backend",
           "init_dist_connection", "sync_ddp_if_available", "init_optimizers_and_lr_schedulers",
           "first_dataloader"]

_LOOPS = ("fit_loop", "validate_loop", "test_loop", "predict_loop")


def first_dataloader(trainer) -> Optional[Any]:
    """The dataloader (or collection of them) the Trainer was given for training, else for
    validation, test, prediction: as given (a `DataLoader`, a list or dict of them) or from the
    LightningModule's / datamodule's ``*_dataloader()`` hook; None when there is none."""
    for name in _LOOPS:
        source = getattr(getattr(trainer, name, None), "_data_source", None)
        if source is not None and source.is_defined():
            return source.dataloader()
    return None
