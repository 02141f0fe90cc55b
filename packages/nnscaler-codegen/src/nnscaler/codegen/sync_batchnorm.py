"""``ComputeConfig.sync_batchnorm``: batch norm calls of the generated code that synchronise their
training-mode batch statistics over the data-parallel replicas (nnscaler.runtime.sync_batchnorm).

`SyncBatchNorm(cfg)` is made once per rank module by `emit_rank`; `wrap(node, lines)` rewrites the
statement of an ``F.batch_norm`` op (what ``nn.BatchNorm1d/2d/3d`` call) from
``y = torch.nn.functional.batch_norm(x, ...)`` to ``y = nr.sync_batchnorm.batch_norm(self, x, ...)``
with the same arguments (``self.training`` included, so eval mode still runs plain batch norm).
Nothing is rewritten unless the config asks for it and the data-parallel degree is above 1.
Instance norm and group norm are per-sample: they are never rewritten.
"""
from __future__ import annotations

from typing import List

from nnscaler.ir import ComputeConfig, Node

from .errors import GenerationError

__all__ = ["SyncBatchNorm", "BATCH_NORM", "RUNTIME_CALL"]

BATCH_NORM = "torch.nn.functional.batch_norm"
RUNTIME_CALL = "nr.sync_batchnorm.batch_norm"


class SyncBatchNorm:
    def __init__(self, cfg: ComputeConfig):
        self.enabled = cfg.sync_batchnorm and cfg.dp_size > 1

    def wrap(self, node: Node, lines: List[str]) -> List[str]:
        if not self.enabled or node.target != BATCH_NORM:
            return lines
        call = BATCH_NORM + "("
        if len(lines) != 1 or lines[0].count(call) != 1:
            raise GenerationError(f"ComputeConfig.sync_batchnorm: cannot rewrite the batch norm op "
                                  f"{node.describe()} (generated as {lines!r})")
        return [lines[0].replace(call, RUNTIME_CALL + "(self, ")]
