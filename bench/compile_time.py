"""Compile-time cost of nnscaler (trace, policy, codegen) for the example GPT at growing depth.

    python bench/compile_time.py [--layers 4 8 16 32] [--policies dp tp] [--repeats 5]

Single process, no torch.distributed. The model is the example GPT at n_embd 256, block_size 64
(the sequence), batch 2, 4 heads: the size the compile-time goal is stated for (32 layers in 1 s).
For each depth, `--repeats` times (a fresh trace each time):

* trace   : nnscaler.ir.trace(model, dummy, constant_folding=False, trace_strategy='cpu'): the forward
            in training and in eval mode, the eval run taking the training run's results where they
            cannot differ (nnscaler.ir.tracer.replay). Also timed, not in the total: the same with
            replay=False (every call of the second run computed: how tracing cost before replay) and
            with both_modes=False (one mode: the floor).
* policy  : nnscaler.policies.apply_policy(graph, config, policy) per policy: 'dp' on
            ComputeConfig(1, 2) (whole ops, data parallel over 2 ranks), 'tp' on ComputeConfig(2, 2)
            (ops split over 2 ranks);
* codegen : nnscaler.codegen.generate(graph, same config, tmpdir, policy=..., fingerprint=...) -> 2 rank
            files and the plan report, with the graph's fingerprint computed first and timed with it
            (as parallelize() does, once for both ranks).

Each phase is timed with time.perf_counter (wall) and time.process_time (this process's CPU time,
which other load on a shared machine disturbs much less), gc.collect() before it; the best (min)
and the median of the repeats are recorded; the tables use the best. Then, per phase and in total,
the growth against depth: t(max)/t(min) against linear growth, a least-squares slope (s per layer)
and the log-log exponent k of t ~ layers^k (k = 1: linear). The load average before and after is
in the JSON. One intra-op thread by default: with torch's default thread count a loaded 2-core
machine adds random stalls to the traced forward. Writes bench/results/compile_time.json.
"""
from __future__ import annotations

import argparse
import gc
import inspect
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
CONFIGS = {"dp": (1, 2), "tp": (2, 2)}  # policy -> (plan_ngpus, runtime_ngpus)


def _timed(fn):
    gc.collect()
    w0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w0, time.process_time() - c0


def _copy(graph):
    from nnscaler.ir import IRGraph
    copy = IRGraph.from_json(graph.to_json())
    copy.constants = graph.constants  # tensors are not in the JSON
    return copy


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
    can_replay = "replay" in inspect.signature(trace).parameters  # (to run this script on older code)
    traces = {"trace": {}, "trace_no_replay": {"replay": False}, "trace_one_mode": {"both_modes": False}}
    if not can_replay:
        del traces["trace_no_replay"]
    wall = {k: [] for k in traces}
    cpu = {k: [] for k in traces}
    per_policy = {p: {"wall": {"policy": [], "codegen": []}, "cpu": {"policy": [], "codegen": []}}
                  for p in args.policies}
    nodes, lines = 0, {}
    for r in range(args.repeats):
        for name, kwargs in traces.items():
            graph, w, c = _timed(lambda: trace(model, dummy, constant_folding=False, trace_strategy="cpu", **kwargs))
            wall[name].append(w)
            cpu[name].append(c)
            if name == "trace":
                traced = graph
        nodes = len(traced.nodes)
        for policy in args.policies:
            cc = ComputeConfig(*CONFIGS[policy], trace_strategy="cpu")
            graph = _copy(traced)
            graph, w, c = _timed(lambda: apply_policy(graph, cc, policy))
            per_policy[policy]["wall"]["policy"].append(w)
            per_policy[policy]["cpu"]["policy"].append(c)
            outdir = outroot / f"L{n_layer}_{policy}_r{r}"
            paths, w, c = _timed(lambda: generate(graph, cc, outdir, policy=policy, fingerprint=graph.fingerprint()))
            per_policy[policy]["wall"]["codegen"].append(w)
            per_policy[policy]["cpu"]["codegen"].append(c)
            lines[policy] = sum(len(Path(p).read_text().splitlines()) for p in paths)
        del traced, graph

    def stats(series):
        return {"best": min(series), "median": statistics.median(series), "all": series}

    result = {"layers": n_layer, "graph_nodes": nodes, "generated_lines_all_ranks": lines,
              "trace": {k: {"wall_s": stats(wall[k]), "cpu_s": stats(cpu[k])} for k in traces},
              "policies": {}}
    for policy, t in per_policy.items():
        entry = {}
        for clock in ("wall", "cpu"):
            best = {"trace": min(wall["trace"] if clock == "wall" else cpu["trace"]),
                    "policy": min(t[clock]["policy"]), "codegen": min(t[clock]["codegen"])}
            best["total"] = sum(best[p] for p in PHASES)  # sum of per-phase bests
            entry[f"{clock}_best_s"] = best
            entry[f"{clock}_median_s"] = {"policy": statistics.median(t[clock]["policy"]),
                                          "codegen": statistics.median(t[clock]["codegen"])}
            entry[f"{clock}_all_s"] = t[clock]
        result["policies"][policy] = entry
    return result


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
    p.add_argument("--policies", nargs="+", default=["dp", "tp"], choices=sorted(CONFIGS))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--embd", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--block-size", type=int, default=64)
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

    load_before = _common.loadavg()
    t_start = time.perf_counter()
    print(f"compile time: GPT n_embd={args.embd} block_size={args.block_size} batch={args.batch}, layers {layers}, "
          f"policies {args.policies} on 2 ranks, best of {args.repeats}; load average {load_before}", flush=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="nnscaler_compile_bench_") as tmp:
        # untimed warm-up: imports, first-call caches
        measure(2, argparse.Namespace(**{**vars(args), "repeats": 1}), Path(tmp) / "warmup")
        for n in layers:
            res = measure(n, args, Path(tmp))
            results.append(res)
            tr = res["trace"]
            print(f"  {n:3d} layers ({res['graph_nodes']} nodes): trace {tr['trace']['wall_s']['best']:.3f} s wall / "
                  f"{tr['trace']['cpu_s']['best']:.3f} s cpu"
                  + (f" (no replay {tr['trace_no_replay']['cpu_s']['best']:.3f} s cpu" if "trace_no_replay" in tr else " (")
                  + f", one mode {tr['trace_one_mode']['cpu_s']['best']:.3f} s cpu); "
                  + "; ".join(f"{pol} policy {e['cpu_best_s']['policy']:.3f} codegen {e['cpu_best_s']['codegen']:.3f} "
                              f"total {e['wall_best_s']['total']:.3f} s wall / {e['cpu_best_s']['total']:.3f} s cpu"
                              for pol, e in res["policies"].items()), flush=True)
    wall = time.perf_counter() - t_start
    load_after = _common.loadavg()

    lo, hi = results[0], results[-1]
    linear = hi["layers"] / lo["layers"]
    growth = {}
    for policy in args.policies:
        print(f"\npolicy {policy} (ComputeConfig{CONFIGS[policy]}): best of {args.repeats}, seconds")
        rows = []
        for res in results:
            e, tr = res["policies"][policy], res["trace"]
            row = [res["layers"], res["graph_nodes"]]
            for clock in ("wall", "cpu"):
                b = e[f"{clock}_best_s"]
                row += [f"{b[ph]:.3f}" for ph in (*PHASES, "total")]
            row.append(f"{tr['trace_no_replay']['cpu_s']['best']:.3f}" if "trace_no_replay" in tr else "-")
            row.append(f"{tr['trace_one_mode']['cpu_s']['best']:.3f}")
            rows.append(row)
        print(_common.table(["layers", "nodes", "trace", "policy", "codegen", "total", "trace cpu", "policy cpu",
                             "codegen cpu", "total cpu", "trace no-replay cpu", "trace one-mode cpu"], rows))
        xs = [r["layers"] for r in results]
        srows, growth[policy] = [], {}
        for ph in (*PHASES, "total"):
            ys = [r["policies"][policy]["cpu_best_s"][ph] for r in results]
            a, b, k = _fit(xs, ys)
            ratio = ys[-1] / ys[0]
            growth[policy][ph] = {"clock": "cpu", "ratio": ratio, "linear_ratio": linear,
                                  "ratio_over_linear": ratio / linear, "slope_s_per_layer": b, "intercept_s": a,
                                  "loglog_exponent": k,
                                  "ms_per_layer_at": {str(x): 1e3 * y / x for x, y in zip(xs, ys)}}
            verdict = "<= linear" if ratio / linear <= 1.10 and k <= 1.10 else "SUPERLINEAR"
            srows.append([ph, f"{ratio:.2f}", f"{linear:.0f}", f"{ratio / linear:.2f}", f"{1e3 * b:.2f}",
                          f"{a:.3f}", f"{k:.2f}", verdict])
        print(_common.table(["phase (cpu)", f"t({hi['layers']})/t({lo['layers']})", "linear", "/linear",
                             "slope ms/layer", "intercept s", "exponent k", "verdict"], srows))
    tr = hi["trace"]
    if "trace_no_replay" in tr:
        print(f"\n{hi['layers']} layers: trace with replay / without: "
              f"{tr['trace']['cpu_s']['best'] / tr['trace_no_replay']['cpu_s']['best']:.2f} (cpu), "
              f"{tr['trace']['wall_s']['best'] / tr['trace_no_replay']['wall_s']['best']:.2f} (wall)")
    print(f"total wall time {wall:.1f} s; load average before {load_before}, after {load_after}")

    data = {
        **_common.run_header(),
        "config": {"model": {"n_embd": args.embd, "n_head": args.heads, "block_size": args.block_size,
                             "vocab_size": args.vocab, "use_sdpa": False}, "batch": args.batch,
                   "policies": {p: f"ComputeConfig{CONFIGS[p]}, trace_strategy='cpu'" for p in args.policies},
                   "repeats": args.repeats, "statistic": "best (min) of repeats; median also recorded",
                   "clocks": "wall: time.perf_counter; cpu: time.process_time of this process",
                   "torch_threads": torch.get_num_threads()},
        "load_average": {"before": load_before, "after": load_after},
        "results": results,
        "growth": growth,
        "wall_seconds": wall,
    }
    _common.save_results(args.out, data)


if __name__ == "__main__":
    main()
