"""Cost of the module's random stream (runtime/random.py) per forward, one process.

    python bench/random_streams.py [--layers 4] [--steps 200] [--block 20]

A stack of `--layers` x (Linear, GELU, Dropout(0.1)) parallelized with `'dp', ComputeConfig(1, 1)`
(rng_mode 'parallel') in two sizes: `small` (width 64, batch 8: the swap is the largest share)
and `medium` (width 512, batch 64). Per size it times, in the same process on the same module:

* `streams`    : forward as shipped: the module's stream swapped into the default generator at
                 entry and the user's swapped back at exit (4 generator-state copies of 5 KB);
* `no_streams` : the same module with the swap turned off (the reference: what the forward cost
                 before random streams; dropout then draws from the user's generator).

Alternating blocks of `--block` forwards (training mode, under torch.no_grad, and forward +
backward), medians over blocks; the ratio streams / no_streams is the overhead. Also the swap
alone (`with pm.rng_scope(): pass`) in microseconds. Writes bench/results/random_streams.json.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402


class DropMLP(nn.Module):
    def __init__(self, width: int, layers: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        for layer in self.layers:
            x = self.drop(torch.nn.functional.gelu(layer(x)))
        return x.sum()


def _time_block(fn, n):
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def measure(name, width, batch, args, gen_dir):
    from nnscaler import ComputeConfig, parallelize
    torch.manual_seed(0)
    pm = parallelize(DropMLP(width, args.layers), {"x": torch.randn(batch, width)}, "dp",
                     ComputeConfig(1, 1, trace_strategy="cpu"), gen_savedir=gen_dir, instance_name=name)
    streams = pm._random_streams
    nops = streams.nops
    x = torch.randn(batch, width)

    def fwd():
        with torch.no_grad():
            pm(x)

    def step():
        pm(x).backward()

    out = {"width": width, "batch": batch, "layers": args.layers, "random_ops": nops}
    for label, fn in (("forward_no_grad", fwd), ("forward_backward", step)):
        for _ in range(args.warmup):
            fn()
        times = {"streams": [], "no_streams": []}
        rounds = max(1, args.steps // args.block)
        for r in range(rounds):
            order = ("streams", "no_streams") if r % 2 == 0 else ("no_streams", "streams")
            for variant in order:
                streams.nops = nops if variant == "streams" else 0
                times[variant].append(_time_block(fn, args.block))
        streams.nops = nops
        med = {k: _common.median(v) for k, v in times.items()}
        paired = _common.median([a / b for a, b in zip(times["streams"], times["no_streams"])])
        out[label] = {"ms_streams": med["streams"] * 1e3, "ms_no_streams": med["no_streams"] * 1e3,
                      "ratio_of_medians": med["streams"] / med["no_streams"], "ratio_paired": paired,
                      "raw_s": times}

    def swap():
        with pm.rng_scope():
            pass
    swap_times = [_time_block(swap, 1000) for _ in range(5)]
    out["swap_us"] = _common.median(swap_times) * 1e6
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--block", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--out", default=str(_common.RESULTS_DIR / "random_streams.json"))
    args = _common.parse_args(parser, {"layers": 1, "steps": 2, "block": 1, "warmup": 1}, "random_streams.json")
    torch.set_num_threads(1)
    results = {}
    with tempfile.TemporaryDirectory() as gen_dir:
        for name, width, batch in (("small", 64, 8), ("medium", 512, 64)):
            results[name] = measure(name, width, batch, args, gen_dir)
    rows = []
    for name, r in results.items():
        for label in ("forward_no_grad", "forward_backward"):
            m = r[label]
            rows.append([f"{name} {label}", f"{m['ms_no_streams']:.3f}", f"{m['ms_streams']:.3f}",
                         f"{m['ratio_of_medians']:.3f}", f"{m['ratio_paired']:.3f}"])
    print(_common.table(["case", "ms no_streams", "ms streams", "ratio", "ratio (paired)"], rows))
    print("swap alone: " + ", ".join(f"{n} {r['swap_us']:.1f} us" for n, r in results.items()))
    _common.save_results(args.out, {**_common.run_header(), "threads": 1, "config": vars(args),
                                    "results": results, "loadavg": _common.loadavg()})


if __name__ == "__main__":
    main()
