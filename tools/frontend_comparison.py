"""Evidence for the choice of tracing front end (docs/architecture.md, "Tracing front end").

    python tools/frontend_comparison.py [--layers 8]

Traces the same models with torch.fx.symbolic_trace, torch.export.export (training IR) and
nnscaler's concrete tracer, and records for each: whether it traced, seconds, number of ops, and
whether the ops keep the user's module path and source line. Writes
bench/results/frontend_comparison.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
from gpt import GPT, GPTConfig, random_batch  # noqa: E402


class ShapeBranch(nn.Module):
    """Control flow on shapes and constants (must trace)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        if x.size(-1) > 8:
            x = self.fc(x)
        for _ in range(x.shape[0] // 2):
            x = F.gelu(x)
        return x.view(x.size(0), -1, 4).sum()


def run_fx(model, args):
    gm = torch.fx.symbolic_trace(model)
    ops = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    return len(ops), all("nn_module_stack" in n.meta for n in ops), False


def run_export(model, args):
    ep = torch.export.export(model, (), args, strict=False)
    ops = [n for n in ep.graph.nodes if n.op == "call_function"]
    has_module = all(n.meta.get("nn_module_stack") for n in ops)
    has_source = all(n.meta.get("stack_trace") for n in ops)
    return len(ops), has_module, has_source


def run_nnscaler(model, args):
    from nnscaler.ir import trace
    g = trace(model, args, trace_strategy="cpu")
    return len(g.nodes), all(n.module_path is not None for n in g.nodes), all(n.source for n in g.nodes)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=8)
    args = p.parse_args()
    cfg = GPTConfig(vocab_size=64, block_size=32, n_layer=args.layers, n_head=4, n_embd=64)
    cases = {f"gpt_{args.layers}_layers": (GPT(cfg), random_batch(0, 4, cfg)),
             "shape_control_flow": (ShapeBranch(), {"x": torch.randn(4, 16)})}
    results = {}
    warnings.simplefilter("ignore")
    for case, (model, batch) in cases.items():
        for name, fn in (("torch.fx.symbolic_trace", run_fx), ("torch.export (training IR)", run_export),
                         ("nnscaler concrete tracer", run_nnscaler)):
            t0 = time.perf_counter()
            try:
                n_ops, module_paths, source_lines = fn(model, batch)
                row = {"ok": True, "ops": n_ops, "module_paths": module_paths, "source_lines": source_lines}
            except Exception as e:  # noqa: BLE001 - the failure is the finding
                row = {"ok": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}
            row["seconds"] = round(time.perf_counter() - t0, 3)
            results.setdefault(case, {})[name] = row
            print(f"{case:22s} {name:28s} {json.dumps(row)}")
    out = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "results",
                       "frontend_comparison.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"torch": torch.__version__, "command": "python tools/frontend_comparison.py", "results": results},
                  f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
