"""Compile-time cost of nnscaler (trace, policy, codegen) for the example GPT at growing depth.

    python bench/compile_time.py [--layers 4 8 16 32] [--repeats 5]

Single process, no torch.distributed. For each depth, `--repeats` times (a fresh trace each time):

* trace   : nnscaler.ir.tracer.trace(model, dummy_args, constant_folding=False, trace_strategy='cpu')
            (the forward in training and in eval mode); also timed alone, not in the total: the
            same with both_modes=False (one mode), the reference for the cost of the second mode
* policy  : nnscaler.policies.apply_policy(graph, ComputeConfig(1, 2, trace_strategy='cpu'), 'dp')
* codegen : nnscaler.codegen.generate(graph, same config, tmpdir, policy='dp') -> 2 rank files

Each phase is timed with time.perf_counter (gc.collect() before it); the best (min) and the
median of the repeats are recorded; the table uses the best. Then, per phase and in total: the
time per layer, the growth from the smallest to the largest depth against linear growth
(t(32)/t(4) vs 32/4 = 8), a least-squares line t = a + b * layers (b: seconds per layer) and the
log-log exponent k of t ~ layers^k (k = 1: linear). Target: no faster than linear.

Model dimensions are small (compile time depends on the number of operators, not on tensor
sizes; trace_strategy='cpu' does run the forward once). One intra-op thread by default: with
torch's default thread count a loaded 2-core machine adds random ~0.5 s stalls to the traced
forward, which hide the scaling. Writes bench/results/compile_time.json.
"""
from __future__ import annotations

import argparse
import gc
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

_common.add_examples_to_path()

import torch  # noqa: E402

PHASES = ("trace", "policy", "codegen")


def _timed(fn):
    gc.collect()
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def measure(n_layer: int, args, outroot: Path) -> dict:
    from gpt import GPT, GPTConfig, random_batch
    from nnscaler import ComputeConfig
    from nnscaler.codegen import generate
    from nnscaler.ir import trace
    from nnscaler.policies import apply_policy

    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.block_size, n_layer=n_layer,
                    n_head=args.heads, n_embd=args.embd, use_sdpa=False)
    torch.manual_seed(0)
    model = GPT(cfg)
    dummy = random_batch(0, args.batch, cfg)
    cc = ComputeConfig(1, 2, trace_strategy="cpu")
    times = {p: [] for p in (*PHASES, "trace_one_mode")}
    nodes = lines = 0
    for r in range(args.repeats):
        _, t = _timed(lambda: trace(model, dummy, constant_folding=False, trace_strategy="cpu", both_modes=False))
        times["trace_one_mode"].append(t)
        graph, t = _timed(lambda: trace(model, dummy, constant_folding=False, trace_strategy="cpu"))
        times["trace"].append(t)
        nodes = len(graph.nodes)
        graph, t = _timed(lambda: apply_policy(graph, cc, "dp"))
        times["policy"].append(t)
        outdir = outroot / f"L{n_layer}_r{r}"
        paths, t = _timed(lambda: generate(graph, cc, outdir, policy="dp"))
        times["codegen"].append(t)
        lines = sum(len(Path(p).read_text().splitlines()) for p in paths)
        del graph
    best = {p: min(v) for p, v in times.items()}
    best["total"] = sum(best[p] for p in PHASES)  # sum of per-phase bests
    med = {p: statistics.median(v) for p, v in times.items()}
    med["total"] = sum(med[p] for p in PHASES)
    return {"layers": n_layer, "graph_nodes": nodes, "generated_lines_all_ranks": lines, "rank_files": len(paths),
            "best_s": best, "median_s": med, "all_s": times}


def _fit(xs, ys):
    """Least squares y = a + b x, and the log-log exponent k (y ~ x^k)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    a = my - b * mx
    lx, ly = [math.log(x) for x in xs], [math.log(max(y, 1e-9)) for y in ys]
    mlx, mly = sum(lx) / n, sum(ly) / n
    k = sum((u - mlx) * (v - mly) for u, v in zip(lx, ly)) / sum((u - mlx) ** 2 for u in lx)
    return a, b, k


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, nargs="+", default=[4, 8, 16, 32])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--embd", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (default 1; 0: torch's default, which on a small shared "
                        "machine adds random stalls to the traced forward)")
    p.add_argument("--out", default=str(_common.RESULTS_DIR / "compile_time.json"))
    args = _common.parse_args(p, {"layers": [1, 2], "repeats": 1, "embd": 16, "block_size": 8, "vocab": 16},
                              "compile_time.json")
    layers = sorted(set(args.layers))
    if len(layers) < 2 or layers[0] < 1 or args.repeats < 1:
        p.error("need at least two distinct positive --layers and --repeats >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)

    t_start = time.perf_counter()
    print(f"compile time: GPT n_embd={args.embd} block_size={args.block_size}, layers {layers}, "
          f"best of {args.repeats}, ComputeConfig(1, 2) -> 2 rank files", flush=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="nnscaler_compile_bench_") as tmp:
        # untimed warm-up: imports, first-call caches
        measure(2, argparse.Namespace(**{**vars(args), "repeats": 1}), Path(tmp) / "warmup")
        for n in layers:
            res = measure(n, args, Path(tmp))
            results.append(res)
            b = res["best_s"]
            print(f"  {n:3d} layers: trace {b['trace']:.3f} s (one mode {b['trace_one_mode']:.3f} s), policy "
                  f"{b['policy']:.3f} s, codegen {b['codegen']:.3f} s ({res['graph_nodes']} nodes)", flush=True)
    wall = time.perf_counter() - t_start

    lo, hi = results[0], results[-1]
    linear = hi["layers"] / lo["layers"]
    print()
    rows = []
    for res in results:
        b = res["best_s"]
        rows.append([res["layers"], res["graph_nodes"], *(f"{b[ph]:.3f}" for ph in (*PHASES, "total")),
                     f"{1e3 * b['total'] / res['layers']:.1f}"])
    print(_common.table(["layers", "nodes", "trace s", "policy s", "codegen s", "total s", "total ms/layer"], rows))
    print()
    xs = [r["layers"] for r in results]
    growth, srows = {}, []
    for ph in (*PHASES, "total"):
        ys = [r["best_s"][ph] for r in results]
        a, b, k = _fit(xs, ys)
        ratio = hi["best_s"][ph] / lo["best_s"][ph]
        growth[ph] = {"ratio": ratio, "linear_ratio": linear, "ratio_over_linear": ratio / linear,
                      "slope_s_per_layer": b, "intercept_s": a, "loglog_exponent": k,
                      "ms_per_layer_at": {str(r["layers"]): 1e3 * r["best_s"][ph] / r["layers"] for r in results}}
        verdict = "<= linear" if ratio / linear <= 1.10 and k <= 1.10 else "SUPERLINEAR"
        srows.append([ph, f"{ratio:.2f}", f"{linear:.0f}", f"{ratio / linear:.2f}", f"{1e3 * b:.2f}",
                      f"{a:.3f}", f"{k:.2f}", verdict])
    print(_common.table(["phase", f"t({hi['layers']})/t({lo['layers']})", "linear", "/linear",
                         "slope ms/layer", "intercept s", "exponent k", "verdict"], srows))
    modes = {str(r["layers"]): r["best_s"]["trace"] / r["best_s"]["trace_one_mode"] for r in results}
    print("trace in both modes / trace in one mode (both_modes=False): "
          + ", ".join(f"{k} layers {v:.2f}" for k, v in modes.items()))
    print(f"total wall time {wall:.1f} s")

    data = {
        **_common.run_header(),
        "config": {"model": {"n_embd": args.embd, "n_head": args.heads, "block_size": args.block_size,
                             "vocab_size": args.vocab, "use_sdpa": False}, "batch": args.batch,
                   "compute_config": "ComputeConfig(1, 2, trace_strategy='cpu')", "policy": "dp",
                   "repeats": args.repeats, "statistic": "best (min) of repeats; median also recorded",
                   "torch_threads": torch.get_num_threads()},
        "results": results,
        "growth": growth,
        "trace_both_modes_over_one_mode": modes,
        "wall_seconds": wall,
    }
    _common.save_results(args.out, data)


if __name__ == "__main__":
    main()
