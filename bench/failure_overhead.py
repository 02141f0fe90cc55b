"""Per-step cost of the failure protocol (nnscaler.runtime.failures) on the fast path.

    python bench/failure_overhead.py [--nproc 2] [--steps 60] [--block 5] [--warmup 3]

In `--nproc` gloo CPU processes, the example GPT (examples/gpt.py) is parallelized three ways:

* `dp`            : 'dp', the default (synchronous) reducer, one 25 MB bucket
* `dp_async_tiny` : 'dp', use_async_reducer=True with 0.004 MB buckets (dozens of all-reduces per step)
* `tp`            : 'tp' over all ranks (tensor-parallel collectives in forward and backward)

and each trains with the protocol on (`failures.enabled = True`: watchful waits, a backward
watch per forward) and off (`enabled = False`: plain `work.wait()`, which is what the reducer and
the collectives did before). "Off" is the pre-protocol code path: the reducer always launched its
all-reduce through gloo, whose blocking call is the async call plus `work.wait()`.

The timed phase alternates blocks of `--block` steps on / off (order rotating every round, a
barrier before each block) until each ran `--steps` steps. Reported per config: the median over
blocks of ms/step (slower rank of each block) and the ratio on/off of the medians, of the
per-round pairs (median) and of the best blocks. Writes bench/results/failure_overhead.json.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

_common.add_examples_to_path()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

CONFIGS = {"dp": ("dp", 1, {}), "dp_async_tiny": ("dp", 1, dict(use_async_reducer=True, reducer_bucket_cap_mb=0.004)),
           "tp": ("tp", None, {})}


def _run(rank: int, args) -> dict:
    from gpt import random_batch
    from nnscaler import ComputeConfig, build_optimizer, parallelize
    from nnscaler.runtime import failures

    world = args.nproc
    cfg = _common.gpt_config(args)
    out = {"per_collective_us": _per_collective(args)}
    for name in args.configs:
        policy, plan, extra = CONFIGS[name]
        plan = plan or world
        dp = world // plan
        full = random_batch(0, args.batch * dp, cfg)
        dp_rank = rank // plan
        mine = {k: v[dp_rank * args.batch:(dp_rank + 1) * args.batch].contiguous() for k, v in full.items()}
        pm = parallelize(_common.base_model(args), mine, policy,
                         ComputeConfig(plan, world, trace_strategy="cpu", **extra),
                         gen_savedir=args.gen_dir, instance_name=name, reuse="override")
        opt = build_optimizer(pm, torch.optim.Adam, lr=1e-3)

        def step():
            opt.zero_grad()
            pm(**mine).backward()
            opt.step()

        for on in (True, False) * args.warmup:
            failures.enabled = on
            step()
        per_block = {True: [], False: []}
        rounds = max(1, -(-args.steps // args.block))
        for r in range(rounds):
            for on in ((True, False) if r % 2 == 0 else (False, True)):
                failures.enabled = on
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(args.block):
                    step()
                per_block[on].append((time.perf_counter() - t0) * 1e3 / args.block)
        failures.enabled = True
        flat = torch.tensor([per_block[True], per_block[False]], dtype=torch.float64)
        dist.all_reduce(flat, op=dist.ReduceOp.MAX)  # the slower rank of each block counts
        on_ms, off_ms = flat[0].tolist(), flat[1].tolist()
        out[name] = {
            "buckets": pm.reducer.num_buckets if pm.reducer is not None else 0,
            "on_ms_per_block": on_ms, "off_ms_per_block": off_ms,
            "on_ms": _common.median(on_ms), "off_ms": _common.median(off_ms),
            "ratio_of_medians": _common.median(on_ms) / _common.median(off_ms),
            "ratio_paired_median": _common.median([a / b for a, b in zip(on_ms, off_ms)]),
            "ratio_best_blocks": min(on_ms) / min(off_ms),
        }
    dist.barrier()
    return out


def _per_collective(args) -> dict:
    """µs per 64-float all-reduce: the blocking torch call (before the protocol), the watchful
    wait (on), and the same path with the protocol off; blocks in rotating order, median of blocks."""
    from nnscaler.runtime import failures

    x = torch.ones(64)
    ways = {"blocking": lambda: dist.all_reduce(x),
            "on": lambda: failures.run(dist.all_reduce, x, what="bench"),
            "off": lambda: failures.run(dist.all_reduce, x, what="bench")}
    times = {k: [] for k in ways}
    names = list(ways)
    for r in range(args.collective_rounds):
        for name in names[r % 3:] + names[:r % 3]:  # rotating the order every round
            fn = ways[name]
            failures.enabled = name != "off"
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(args.collective_calls):
                fn()
            times[name].append((time.perf_counter() - t0) * 1e6 / args.collective_calls)
    failures.enabled = True
    flat = torch.tensor([times[k] for k in ways], dtype=torch.float64)
    dist.all_reduce(flat, op=dist.ReduceOp.MAX)
    med = {k: _common.median(flat[i].tolist()) for i, k in enumerate(ways)}
    return {**med, "ratio_on_vs_blocking": med["on"] / med["blocking"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--embd", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--batch", type=int, default=4, help="sequences per data-parallel rank per step")
    p.add_argument("--steps", type=int, default=60, help="timed steps per variant and config")
    p.add_argument("--block", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--collective-calls", type=int, default=200)
    p.add_argument("--collective-rounds", type=int, default=15)
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--out", default=None, help="results file (default bench/results/failure_overhead.json)")
    args = _common.parse_args(p, {"layers": 1, "embd": 16, "heads": 2, "block_size": 8, "vocab": 32, "batch": 2,
                                  "steps": 2, "block": 1, "warmup": 1, "collective_calls": 2,
                                  "collective_rounds": 1}, "failure_overhead.json")
    with tempfile.TemporaryDirectory() as tmp:
        args.gen_dir = tmp
        result, seconds = _common.spawn_gloo(_run, (args,), args.nproc, os.path.join(tmp, "result.json"),
                                             gather=False)
    rows = [[name, f"{r['off_ms']:.2f}", f"{r['on_ms']:.2f}", f"{r['ratio_of_medians']:.3f}",
             f"{r['ratio_paired_median']:.3f}", f"{r['ratio_best_blocks']:.3f}", r["buckets"]]
            for name, r in result.items() if name != "per_collective_us"]
    print(_common.table(["config", "off ms/step", "on ms/step", "on/off (medians)", "paired", "best", "buckets"],
                        rows))
    c = result["per_collective_us"]
    print(f"64-float all-reduce: blocking {c['blocking']:.1f} us, watchful wait {c['on']:.1f} us "
          f"(ratio {c['ratio_on_vs_blocking']:.3f}), protocol off {c['off']:.1f} us")
    data = {**_common.run_header(), "config": {k: v for k, v in vars(args).items() if k != "gen_dir"},
            "threads_per_rank": _common.threads_per_rank(args.nproc), "loadavg": _common.loadavg(),
            "wall_s": seconds, "results": result}
    _common.save_results(args.out or str(_common.RESULTS_DIR / "failure_overhead.json"), data)


if __name__ == "__main__":
    main()
