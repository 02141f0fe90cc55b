"""Models the Trainer builds on the meta device and fills after `parallelize` (docs/fully-sharded.md,
"Building on the meta device").

`MetaBuilt`: a model class whose ``builds_on_meta(args)`` is True is instantiated under
``with torch.device("meta")`` (no memory, no values); `parallelize` then gives each rank only its
local tensors, and the Trainer fills them with ``nnscaler.ckpt.load(model.weights_to_load, pm)``
(a Hugging Face directory or an nnscaler checkpoint: each rank reads only the regions it holds).
`nnscaler.trainer.hf.CausalLM` is one: with ``pretrained`` under a plan that shards parameters
(``plan_ngpus > 1`` or ``use_zero: 3``).
"""
from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch

__all__ = ["MetaBuilt", "builds_on_meta", "meta_scope"]


class MetaBuilt:
    """Mixin: the Trainer builds the model on the meta device when `builds_on_meta(args)` says so
    and loads `weights_to_load` into the parallelized model."""

    weights_to_load: Optional[str] = None

    @classmethod
    def builds_on_meta(cls, args) -> bool:
        return False


def builds_on_meta(kind: Any, args) -> bool:
    """Whether the Trainer builds `model.type` `kind` on the meta device under `args` (TrainerArgs)."""
    return isinstance(kind, type) and issubclass(kind, MetaBuilt) and bool(kind.builds_on_meta(args))


def meta_scope(on: bool):
    """``torch.device("meta")`` when `on`, else nothing."""
    return torch.device("meta") if on else contextlib.nullcontext()
