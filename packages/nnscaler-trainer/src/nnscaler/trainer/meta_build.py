"""Models the Trainer builds on the meta device and fills after `parallelize` (docs/fully-sharded.md,
"Building on the meta device").

`MetaBuilt`: a model class whose ``builds_on_meta(args)`` is True is instantiated under
``with torch.device("meta")`` (no memory, no values); `parallelize` then gives each rank only its
local tensors, and the Trainer fills them with ``nnscaler.ckpt.load(model.weights_to_load, pm)``
(a Hugging Face directory or an nnscaler checkpoint: each rank reads only the regions it holds).
`nnscaler.trainer.hf.CausalLM` is one: under a plan that shards parameters (``plan_ngpus > 1`` or
``use_zero: 3``), with ``pretrained`` or without: then each rank initializes what it holds
(runtime/driver/meta_init.py, the values of building on the CPU with the same seed) unless
`cpu_init_needed` says that replay would differ (the model is then built on the CPU, with a note).
"""
from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch

__all__ = ["MetaBuilt", "builds_on_meta", "cpu_init_needed", "meta_scope"]

# modules whose __init__ draws from torch's generator without a reset_parameters() to replay it
# (transformers' GPT-2 Conv1D: normal_ at build, then _init_weights again): a replay on the rank
# would draw a different stream
NOT_REPLAYABLE = ("Conv1D",)


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


def cpu_init_needed(model: torch.nn.Module, dtype: torch.dtype) -> Optional[str]:
    """Why initializing `model` (built on meta, to be cast to `dtype`) on the ranks would not give
    the values of building it on the CPU with the same seed; None when it would."""
    for m in model.modules():
        if type(m).__name__ in NOT_REPLAYABLE and not callable(getattr(m, "reset_parameters", None)):
            return f"its {type(m).__name__} draws its initial values in __init__, which cannot be replayed on a rank"
    for name, t in (*model.named_parameters(), *model.named_buffers()):
        if t.is_floating_point() and t.dtype != dtype:
            return (f"it is built in {t.dtype} ({name}) and cast to {dtype}: a draw in {dtype} is not a "
                    f"{t.dtype} draw cast")
    return None
