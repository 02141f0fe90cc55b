"""The file names of a generated directory (``<gen_savedir>/<module class>/<instance>/``),
shared by the code generator that writes them and the runtime that reads, checks and sends them.

- ``gencode{rank}.py`` (`gencode_file`): the generated module of one runtime rank;
- `GRAPH_FILE` (+ `CONSTANTS_FILE`): the traced graph and its constant tensors;
- `WEIGHTS_FILE`: the model's initial full weights (read with ``init_params=True``);
- `REPORT_JSON` / `REPORT_TEXT`: the plan report (`PlanReport`, plan_report.py);
- `MANIFEST`: written last, it makes the directory valid (sizes and SHA-256 of the others).
"""
from __future__ import annotations

from .plan_report import REPORT_JSON, REPORT_TEXT

__all__ = ["GENCODE_PREFIX", "gencode_file", "is_gencode_file", "GRAPH_FILE",
           "CONSTANTS_FILE", "WEIGHTS_FILE", "MANIFEST", "REPORT_JSON", "REPORT_TEXT"]

GENCODE_PREFIX = "gencode"
MANIFEST = "manifest.json"
GRAPH_FILE = "graph.json"
CONSTANTS_FILE = "constants.safetensors"
WEIGHTS_FILE = "fullmodel.safetensors"


def gencode_file(rank: int) -> str:
    """The file name of runtime rank `rank`'s generated module."""
    return f"{GENCODE_PREFIX}{int(rank)}.py"


def is_gencode_file(name: str) -> bool:
    """Whether `name` (a file name, not a path) is a generated module."""
    return name.startswith(GENCODE_PREFIX)

