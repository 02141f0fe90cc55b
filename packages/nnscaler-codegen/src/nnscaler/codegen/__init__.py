"""nnscaler.codegen: turn a planned IRGraph into one Python module per runtime rank.

`generate(graph, compute_config, outdir, policy=...)` writes ``gencode{rank}.py``
(``nnscaler.ir.contracts.gencode_file``) for every runtime rank and the plan report
(``plan_report.json`` and ``.txt``, `build_report`) and returns the paths of the rank modules.
Reuse decisions and the manifest are the runtime's (`nnscaler.runtime.driver.parallelize`), which calls
this only when code must be (re)generated.
"""
from __future__ import annotations

from pathlib import Path
from typing import List

from nnscaler.ir import as_compute_config, atomic_write
from nnscaler.ir.contracts import gencode_file

from .emit import emit_rank, param_local_names
from .errors import GenerationError
from .layouts import plan_unit
from .report import REPORT_JSON, REPORT_TEXT, build_report, write_report


def generate(graph, compute_config, outdir, policy: str = "?", fingerprint: str = "") -> List[Path]:
    """Write one module per runtime rank and the plan report into `outdir`; returns the modules' paths."""
    cfg = as_compute_config(compute_config)
    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    paths = []
    unit = plan_unit(graph, cfg.plan_ngpus)
    for rank in range(cfg.runtime_ngpus):
        text = emit_rank(graph, cfg, rank, policy, fingerprint or graph.fingerprint(), unit=unit)
        compile(text, gencode_file(rank), "exec")  # a bug here must not reach the ranks
        paths.append(atomic_write(outdir / gencode_file(rank), text))
    # what the plan split, beside the code (plan_report.json / .txt; see nnscaler.ir.contracts.plan_report)
    write_report(build_report(graph, cfg, policy, unit=unit), outdir)
    return paths


__all__ = ["GenerationError", "generate", "param_local_names", "build_report", "write_report",
           "REPORT_JSON", "REPORT_TEXT"]
