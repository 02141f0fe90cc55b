"""`nnscaler.ckpt.load`: from an nnscaler checkpoint (`load.load`) or from a Hugging Face model
directory (`hf_load`), told apart by the directory's files."""
from __future__ import annotations

from typing import Any, Optional, Union

import torch

from .hf_load import is_hf_directory, load_hf_directory
from .load import load as load_checkpoint

__all__ = ["load"]


def load(path, module: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *,
         verify: Union[str, bool] = "fast") -> Any:
    """Fill `module` (and `optimizer`), of any plan and world size, from `path`. COLLECTIVE.

    `path` is an nnscaler checkpoint directory (sharded, deduped or merged: returns the ``extra``
    saved by this rank, by rank 0 when the world size differs; `verify` as in `load.load`) or a
    Hugging Face model directory (``model.safetensors`` or ``model.safetensors.index.json`` and
    its shards, no ``manifest.json``: returns None; there is no optimizer state, and nothing
    recorded to verify against). Each rank reads only the regions of the tensors it holds."""
    if is_hf_directory(path):
        return load_hf_directory(path, module, optimizer)
    return load_checkpoint(path, module, optimizer, verify=verify)
