"""The class attributes of a generated module: what codegen writes, what the runtime reads.

Every generated ``gencode{rank}.py`` defines one class deriving from the runtime's
``ParallelModule``; `GENERATED_ATTRS` lists the class attributes it may set, in the order codegen
writes them, with their meaning and the default a class that does not set one gets. Codegen
writes from this list (``nnscaler.codegen.module_class``); ``ParallelModule`` derives from
`GeneratedAttrs`, which declares every one with its default and, when a generated class is
created, decodes the literals that have a typed form (``COMPUTE_CONFIG`` -> `ComputeConfig`,
``PIPELINE`` -> `PipelineMeta`).
"""
from __future__ import annotations

import contextlib

from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

from ..config import ComputeConfig, as_compute_config
from .held_tensors import HeldTensor
from .pipeline_meta import PipelineMeta

__all__ = ["GeneratedAttr", "GENERATED_ATTRS", "GENERATED_ATTR_NAMES", "GeneratedAttrs", "decode_pipeline"]


def decode_pipeline(value: Any) -> Optional[PipelineMeta]:
    """``PIPELINE`` as generated (a dict literal) -> `PipelineMeta` (None and PipelineMeta as they are)."""
    if value is None or isinstance(value, PipelineMeta):
        return value
    return PipelineMeta.from_dict(value)


@dataclass(frozen=True)
class GeneratedAttr:
    """name: the class attribute; meaning: what it holds and when codegen writes it; default: its
    value in a class that does not set it; decode: the literal -> its typed form (None: used as is)."""

    name: str
    meaning: str
    default: Any = None
    decode: Optional[Callable[[Any], Any]] = None


GENERATED_ATTRS: Tuple[GeneratedAttr, ...] = (
    GeneratedAttr("COMPUTE_CONFIG", "the ComputeConfig the code was generated for, written as its dict "
                  "(ComputeConfig.to_dict()) and validated into a ComputeConfig when the class is created; "
                  "always written", ComputeConfig(1, 1), as_compute_config),
    GeneratedAttr("RANK", "the runtime rank the file was generated for; building the module on a rank of "
                  "another plan device (rank % plan_ngpus) raises; always written"),
    GeneratedAttr("GRAPH_FINGERPRINT", "the traced graph's fingerprint (program identity); loading the code "
                  "checks it against the manifest's graph_fingerprint; always written"),
    GeneratedAttr("TRACED_TRAINING", "the mode the forward was traced in, which the module starts in "
                  "(nnscaler.ir.tracer.modes); always written", True),
    GeneratedAttr("RANDOM", "the program's random ops, {'mode': rng_mode, 'ops': count} "
                  "(nnscaler.runtime.random); written when there are any"),
    GeneratedAttr("MODE_DIVERGENCE", "the user's line where the other mode runs other ops (a Python branch on "
                  "self.training): that mode is refused; written when there is one"),
    GeneratedAttr("PIPELINE", "the pipeline's stages and crossing values (PipelineMeta, written as its dict "
                  "literal); written for a pipelined plan only", None, decode_pipeline),
    GeneratedAttr("SHARD_UNITS", "use_zero=3's gather units as module paths of the model, resolved from "
                  "pas_config['zero3_units'] (module classes, path globs, paths) against the traced module types "
                  "(contracts.shard_units); written when the config names units"),
    GeneratedAttr("SOURCE_MAP", "generated line number -> the user's source line it runs (error notes); "
                  "always written, filled after the class body", {}),
)

GENERATED_ATTR_NAMES = frozenset(a.name for a in GENERATED_ATTRS)


class GeneratedAttrs:
    """Declares every `GENERATED_ATTRS` entry with its default; a subclass's literal values are
    decoded into their typed form when the subclass is created."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for attr in GENERATED_ATTRS:
            if attr.decode is not None and attr.name in cls.__dict__:
                setattr(cls, attr.name, attr.decode(cls.__dict__[attr.name]))

    def unsharded(self, writeback: bool = False):
        """A context in which every local tensor holds its whole local value (what a checkpoint
        reads or writes). Under fully sharded data parallelism (``use_zero=3``) the runtime gathers
        the parameters for it and, with `writeback`, stores what was written into them back into
        the shards on exit (COLLECTIVE then); otherwise it does nothing."""
        return contextlib.nullcontext()

    def held_tensors(self) -> Optional[Dict[str, HeldTensor]]:
        """The local tensors this rank holds only in parts, by local name (`HeldTensor`: their
        shape, dtype and the flat element ranges held, as views of the held storage), or None when
        every local tensor is held whole (read as ``getattr(self, name)``). Under fully sharded data
        parallelism (``use_zero=3``), once sharded, the runtime names every sharded parameter: a
        checkpoint reads and writes those ranges where they are, with no gather (no collective)."""
        return None


for _attr in GENERATED_ATTRS:
    setattr(GeneratedAttrs, _attr.name, _attr.default)
del _attr
