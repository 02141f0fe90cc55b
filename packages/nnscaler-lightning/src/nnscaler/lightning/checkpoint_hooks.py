"""The checkpoint side of NnScalerStrategy: Lightning's checkpoint hooks through nnscaler.ckpt
(checkpoint.py). Lightning's dict carries no model or optimizer state (`lightning_module_state_dict`
and `optimizer_state` are empty): `save_checkpoint` writes them with nnscaler.ckpt, and
`load_checkpoint` (after setup) fills the parallel module and optimizer before Lightning restores
the rest."""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Union

from . import checkpoint as ckpt_io
from .errors import NnScalerLightningError
from .model_setup import pmodule_of

__all__ = ["CheckpointHooks"]


class CheckpointHooks:
    """Mixed into NnScalerStrategy (needs broadcast, is_global_zero, optimizers, lightning_module,
    state_dict_type)."""

    # -- checkpoints -----------------------------------------------------------------------------
    def lightning_module_state_dict(self) -> Dict[str, Any]:
        return {}  # saved by save_checkpoint through nnscaler.ckpt

    def optimizer_state(self, optimizer) -> Dict[str, Any]:
        return {}  # saved by save_checkpoint through nnscaler.ckpt

    def save_checkpoint(self, checkpoint: Dict[str, Any], filepath, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise NnScalerLightningError("NnScalerStrategy.save_checkpoint(storage_options=...) is not supported: "
                                         "checkpoints are nnscaler.ckpt directories; leave storage_options out")
        path = self.broadcast(os.fspath(filepath))
        if self.is_global_zero:  # ModelCheckpoint's dirpath may not exist yet
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        optimizer = self.optimizers[0] if self.optimizers else None
        ckpt_io.save(path, checkpoint, pmodule_of(self.lightning_module), optimizer, self.state_dict_type)

    def load_checkpoint(self, checkpoint_path, weights_only: Optional[bool] = None) -> Dict[str, Any]:
        """Fill the parallel module (and optimizer) from a checkpoint directory and return
        Lightning's dict. `weights_only` is accepted for Lightning's signature: nothing is ever
        unpickled, so every load is weights-only safe."""
        path = self.broadcast(os.fspath(checkpoint_path))
        optimizer = self.optimizers[0] if self.optimizers else None
        return ckpt_io.load(path, pmodule_of(self.lightning_module), optimizer)

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        pass  # done by load_checkpoint

    def load_optimizer_state_dict(self, checkpoint) -> None:
        pass  # done by load_checkpoint

    def remove_checkpoint(self, filepath) -> None:
        if self.is_global_zero:
            path = Path(filepath)
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            elif path.exists() or path.is_symlink():
                path.unlink()

    @classmethod
    def merge_checkpoint(cls, checkpoint_files: Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]],
                         output_file: Union[str, os.PathLike]) -> None:
        """Merge a checkpoint (its directory, or the files in it) into `output_file`, a directory
        in the merged layout that any plan loads (``fit(ckpt_path=output_file)``). Offline."""
        ckpt_io.merge(checkpoint_files, output_file)
