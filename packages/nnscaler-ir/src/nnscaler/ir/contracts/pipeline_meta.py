"""What a pipelined generated module tells the runtime about its pipeline (`PIPELINE`).

Codegen (``nnscaler.codegen.pipeline_methods``) computes it from the planned graph and writes it
into every rank's module as a literal (identical on all ranks); the runtime's ParallelModule
decodes that literal into a `PipelineMeta` when the class is created (see
``nnscaler.ir.contracts.generated_module``), and the pipeline executor, its inbox and the shared
gradient sync read the typed fields.

Values are named by their graph value id (an int); stages by their index.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Tuple

from ..errors import GenerationError
from ..pipeline_plan import PipelinePlan
from ..schedules import Schedule, get_schedule

__all__ = ["PipelineMeta", "TENSOR", "INT"]

TENSOR, INT = "tensor", "int"  # the kinds of value that cross stages


@dataclass(frozen=True)
class PipelineMeta:
    """nstages, nmicros, scheduler, pp_size, tp_size: the `PipelinePlan`.
    inputs: stage -> the value ids it receives, in order (the ``_acts`` tuple of ``_stage_{s}``).
    outputs: stage -> the value ids it returns, in order (what ``_stage_{s}`` returns).
    producer: crossing or output value id -> the stage that computes it.
    consumers: crossing value id -> the stages that read it (empty for a forward output only).
    kinds: crossing value id -> ``"tensor"`` or ``"int"`` (how it is sent).
    loss: the value id of the loss (the forward's output or its first element), or None.
    shared_groups: every set of plan devices holding one module tensor (gradients summed over it).
    shared: full tensor name -> per local index in a stage, the plan devices holding it, for the
        tensors more than one pipeline device holds (a tied weight, a Chimera stage's weights).
    """

    nstages: int
    nmicros: int
    scheduler: str
    pp_size: int
    tp_size: int
    inputs: Mapping[int, Tuple[int, ...]] = field(default_factory=dict)
    outputs: Mapping[int, Tuple[int, ...]] = field(default_factory=dict)
    producer: Mapping[int, int] = field(default_factory=dict)
    consumers: Mapping[int, Tuple[int, ...]] = field(default_factory=dict)
    kinds: Mapping[int, str] = field(default_factory=dict)
    loss: Optional[int] = None
    shared_groups: Tuple[Tuple[int, ...], ...] = ()
    shared: Mapping[str, Tuple[Tuple[int, ...], ...]] = field(default_factory=dict)

    @property
    def plan(self) -> PipelinePlan:
        return PipelinePlan(self.nstages, self.nmicros, self.scheduler, self.pp_size, self.tp_size)

    def schedule(self) -> Schedule:
        """The schedule the executor walks (the same on every rank)."""
        return get_schedule(self.scheduler, self.nstages, self.nmicros, self.pp_size)

    def is_int(self, vid: int) -> bool:
        """Whether crossing value `vid` is sent as an int (else as a tensor)."""
        return self.kinds[vid] == INT

    def to_dict(self) -> Dict[str, Any]:
        """Python literal (int keys; tuples become lists); `from_dict` also reads its JSON form."""
        return {"nstages": self.nstages, "nmicros": self.nmicros, "scheduler": self.scheduler,
                "pp_size": self.pp_size, "tp_size": self.tp_size,
                "inputs": {s: list(v) for s, v in self.inputs.items()},
                "outputs": {s: list(v) for s, v in self.outputs.items()},
                "producer": dict(self.producer), "consumers": {k: list(v) for k, v in self.consumers.items()},
                "kinds": dict(self.kinds), "loss": self.loss, "shared_groups": [list(g) for g in self.shared_groups],
                "shared": {name: [list(h) for h in per_index] for name, per_index in self.shared.items()}}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "PipelineMeta":
        def ids(v):
            return tuple(int(x) for x in v)

        try:
            return cls(int(data["nstages"]), int(data["nmicros"]), str(data["scheduler"]), int(data["pp_size"]),
                       int(data["tp_size"]),
                       inputs={int(s): ids(v) for s, v in data.get("inputs", {}).items()},
                       outputs={int(s): ids(v) for s, v in data.get("outputs", {}).items()},
                       producer={int(k): int(v) for k, v in data.get("producer", {}).items()},
                       consumers={int(k): ids(v) for k, v in data.get("consumers", {}).items()},
                       kinds={int(k): str(v) for k, v in data.get("kinds", {}).items()},
                       loss=None if data.get("loss") is None else int(data["loss"]),
                       shared_groups=tuple(ids(g) for g in data.get("shared_groups", ())),
                       shared={str(n): tuple(ids(h) for h in per_index)
                               for n, per_index in data.get("shared", {}).items()})
        except (KeyError, TypeError, ValueError) as e:
            raise GenerationError(f"malformed pipeline metadata (PIPELINE): {type(e).__name__}: {e}") from None
