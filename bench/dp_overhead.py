"""Step time of a `dp`-parallelized GPT against torch DDP on the same model, same processes.

    python bench/dp_overhead.py [--nproc 2] [--layers 4] [--steps 100] [--block 5] [--warmup 5]

`--nproc` gloo CPU processes (torch.multiprocessing.spawn) each build, from the same initial
weights (examples/gpt.py, seed 0):

* `nnscaler`       : parallelize(model, ..., 'dp', ComputeConfig(1, nproc)) + build_optimizer(Adam)
* `nnscaler_async` : the same with ComputeConfig(use_async_reducer=True)
* `ddp`            : torch.nn.parallel.DistributedDataParallel(model) + torch.optim.Adam (the reference)

All three train on the same batches (each rank its own slice of a global batch), with the same
optimizer and the same gradient bucket size (25 MB, both defaults). DDP runs with
no per-forward buffer sync (`forward_sync_buffers=False`, older torch:
`broadcast_buffers=False`): the GPT's only buffers are constant causal masks and nnscaler does not
sync buffers either (`--ddp-broadcast-buffers` restores DDP's default).

After `--warmup` interleaved steps of each (their losses must agree: same init, same data), the
timed phase alternates blocks of `--block` steps of each variant (rotating the order every round,
a barrier before every block) until every variant ran `--steps` timed steps, so slow drift of
the machine hits all variants alike. Reported: the median over blocks of ms/step (the slower rank
of each block) and nnscaler/DDP ratios: of the medians (headline), the median of per-round ratios
(paired) and of the best blocks (min/min, least disturbed by other load on a shared machine).
Each rank gets max(1, cores // nproc) intra-op threads.

Writes bench/results/dp_overhead.json. `--profile` additionally profiles rank 0 (cProfile, after
the timed phase; all ranks run the steps) for `--profile-steps` steps of each variant, prints the
top functions and saves bench/results/dp_overhead_<variant>_rank0.prof (pstats files).
"""
from __future__ import annotations

import argparse
import copy
import cProfile
import inspect
import io
import os
import pstats
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

_common.add_examples_to_path()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

TARGET_RATIO = 1.10
VARIANTS = ("nnscaler", "nnscaler_async", "ddp")


# -- per process ------------------------------------------------------------------------------------

def _build(rank: int, args):
    from gpt import GPT, GPTConfig, random_batch
    from nnscaler import ComputeConfig, build_optimizer, parallelize
    from torch.nn.parallel import DistributedDataParallel as DDP

    world = args.nproc
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.block_size, n_layer=args.layers,
                    n_head=args.heads, n_embd=args.embd, use_sdpa=False)
    torch.manual_seed(0)
    base = GPT(cfg)
    n_params = sum(p.numel() for p in base.parameters())
    per_rank = args.batch
    global_batch = per_rank * world
    batches = []
    for s in range(args.distinct_batches):
        full = random_batch(s, global_batch, cfg)
        batches.append({k: v[rank * per_rank:(rank + 1) * per_rank].contiguous() for k, v in full.items()})

    models = {}
    for name, use_async in (("nnscaler", False), ("nnscaler_async", True)):
        cc = ComputeConfig(1, world, trace_strategy="cpu", use_async_reducer=use_async,
                           reducer_bucket_cap_mb=args.bucket_mb)
        pm = parallelize(copy.deepcopy(base), batches[0], "dp", cc, gen_savedir=args.gen_dir,
                         instance_name=name, reuse="override")
        opt = build_optimizer(pm, torch.optim.Adam, lr=args.lr)
        models[name] = (pm, opt)
    ddp_kwargs = {"bucket_cap_mb": args.ddp_bucket_mb}
    if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters:  # newer torch
        ddp_kwargs["forward_sync_buffers"] = args.ddp_broadcast_buffers
    else:
        ddp_kwargs["broadcast_buffers"] = args.ddp_broadcast_buffers
    ddp = DDP(copy.deepcopy(base), **ddp_kwargs)
    models["ddp"] = (ddp, torch.optim.Adam(ddp.parameters(), lr=args.lr))
    info = {"params": n_params, "global_batch": global_batch,
            "nnscaler_buckets": models["nnscaler"][0].reducer.num_buckets
            if models["nnscaler"][0].reducer is not None else 0}
    return models, batches, info


def _profile(rank: int, models, batches, steps: int, top: int, save_dir: str) -> dict:
    """cProfile `steps` steps of each variant. Every rank runs the steps (they contain
    collectives); only rank 0 profiles. Returns rank 0's top functions by tottime."""
    out = {}
    for name in VARIANTS:
        model, opt = models[name]
        dist.barrier()
        prof = cProfile.Profile() if rank == 0 else None
        if prof:
            prof.enable()
        for i in range(steps):
            _common.timed_step(model, opt, batches[i % len(batches)])
        if prof:
            prof.disable()
            prof.dump_stats(os.path.join(save_dir, f"dp_overhead_{name}_rank0.prof"))
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
            out[name] = buf.getvalue()
    return out


def _run(rank: int, args) -> dict:
    models, batches, info = _build(rank, args)
    names = list(VARIANTS)
    counters = {n: 0 for n in names}

    def batch_for(name):
        b = batches[counters[name] % len(batches)]
        counters[name] += 1
        return b

    # warm up, interleaved; every variant sees the same batch sequence -> losses must agree
    losses = {n: [] for n in names}
    for _ in range(args.warmup):
        for n in names:
            model, opt = models[n]
            losses[n].append(_common.timed_step(model, opt, batch_for(n)).item())
    loss_t = torch.tensor([losses[n] for n in names], dtype=torch.float64)
    dist.all_reduce(loss_t)
    loss_t /= args.nproc
    mean_losses = {n: loss_t[i].tolist() for i, n in enumerate(names)}

    # timed: alternate blocks, rotating the order each round
    rounds = max(1, -(-args.steps // args.block))
    per_block = {n: [] for n in names}
    phases = {n: [0.0, 0.0, 0.0] for n in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            model, opt = models[n]
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(args.block):
                _common.timed_step(model, opt, batch_for(n), phases[n])
            per_block[n].append((time.perf_counter() - t0) * 1e3 / args.block)
    # the slower rank of each block counts
    flat = torch.tensor([per_block[n] for n in names], dtype=torch.float64)
    dist.all_reduce(flat, op=dist.ReduceOp.MAX)
    per_block = {n: flat[i].tolist() for i, n in enumerate(names)}
    ph = torch.tensor([phases[n] for n in names], dtype=torch.float64)
    dist.all_reduce(ph)
    ph = ph / args.nproc * 1e3 / (rounds * args.block)
    phase_ms = {n: dict(zip(("forward", "backward", "optimizer"), ph[i].tolist())) for i, n in enumerate(names)}
    stats = {}
    pm = models["nnscaler"][0]
    if pm.reducer is not None:
        s = pm.reducer.stats
        stats = {"allreduce_calls": s.allreduce_calls, "synced_passes": s.synced_passes,
                 "allreduce_bytes": s.allreduce_bytes}
    profiles = None
    if args.profile:
        profiles = _profile(rank, models, batches, args.profile_steps, args.profile_top, args.profile_dir)
    dist.barrier()
    return {"info": info, "losses": mean_losses, "per_block_ms": per_block, "phase_ms": phase_ms,
            "rounds": rounds, "reducer_stats": stats, "profiles": profiles}


# -- launcher -----------------------------------------------------------------------------------------

def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2, help="gloo processes (default 2)")
    p.add_argument("--layers", type=int, default=4, help="GPT blocks (default 4)")
    p.add_argument("--embd", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--block-size", type=int, default=64, help="sequence length")
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--steps", type=int, default=100, help="timed steps per variant (default 100)")
    p.add_argument("--block", type=int, default=5, help="steps per timed block (default 5)")
    p.add_argument("--warmup", type=int, default=5, help="warm-up steps per variant (default 5)")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="gradient bucket cap, both (default 25)")
    p.add_argument("--ddp-bucket-mb", type=float, default=None,
                   help="DDP's bucket cap if different (default: --bucket-mb). The two close buckets "
                        "differently (nnscaler: never above the cap; DDP: at the first param that "
                        "reaches it), so small caps give nnscaler more buckets")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--distinct-batches", type=int, default=8)
    p.add_argument("--ddp-broadcast-buffers", action="store_true",
                   help="DDP's default buffer broadcast every forward (off: nnscaler does not do it)")
    p.add_argument("--threads", type=int, default=None, help="intra-op threads per rank (default cores // nproc)")
    p.add_argument("--profile", action="store_true", help="cProfile rank 0 after the timed phase")
    p.add_argument("--profile-steps", type=int, default=20)
    p.add_argument("--profile-top", type=int, default=25)
    p.add_argument("--out", default=str(_common.RESULTS_DIR / "dp_overhead.json"))
    args = _common.parse_args(p, {"layers": 1, "embd": 16, "heads": 2, "block_size": 8, "vocab": 32, "batch": 2,
                                  "steps": 2, "block": 1, "warmup": 1, "distinct_batches": 2}, "dp_overhead.json")
    if args.nproc < 2:
        p.error("--nproc must be >= 2 (data parallelism needs more than one process)")
    if args.warmup < 1 or args.steps < 1 or args.block < 1:
        p.error("--warmup, --steps and --block must be >= 1")
    if args.ddp_bucket_mb is None:
        args.ddp_bucket_mb = args.bucket_mb
    cores = _common.cpu_count()
    args.threads = args.threads or max(1, cores // args.nproc)
    args.profile_dir = str(_common.RESULTS_DIR)
    if args.profile:
        _common.RESULTS_DIR.mkdir(parents=True, exist_ok=True)

    load_before = _common.loadavg()
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="nnscaler_bench_") as tmp:
        args.gen_dir = os.path.join(tmp, "gen")
        print(f"dp overhead: GPT n_layer={args.layers} n_embd={args.embd} block_size={args.block_size} "
              f"batch/rank={args.batch}, {args.nproc} gloo processes x {args.threads} thread(s) "
              f"({cores} cores), {args.steps} timed steps/variant in blocks of {args.block}", flush=True)
        result, _ = _common.spawn_gloo(_run, (args,), args.nproc, os.path.join(tmp, "result.json"),
                                       threads=args.threads, gather=False)
    wall = time.perf_counter() - t_start
    load_after = _common.loadavg()

    blocks = result["per_block_ms"]
    med = {n: _common.median(blocks[n]) for n in VARIANTS}
    ddp = med["ddp"]
    # per-round paired ratios (same round, adjacent blocks) as a drift-robust cross-check
    paired = {n: _common.median([a / b for a, b in zip(blocks[n], blocks["ddp"])]) for n in ("nnscaler", "nnscaler_async")}
    ratio = {n: med[n] / ddp for n in ("nnscaler", "nnscaler_async")}
    # best blocks (least disturbed by other load on the machine)
    best_ratio = {n: min(blocks[n]) / min(blocks["ddp"]) for n in ("nnscaler", "nnscaler_async")}

    losses = result["losses"]
    loss0 = {n: losses[n][0] for n in VARIANTS}
    max_diff = max(abs(a - b) for n in ("nnscaler", "nnscaler_async") for a, b in zip(losses[n], losses["ddp"]))
    print()
    print("step-0 loss (mean over ranks): " + ", ".join(f"{n} {loss0[n]:.6f}" for n in VARIANTS))
    print(f"max |loss - ddp loss| over {args.warmup} warm-up steps: {max_diff:.2e}"
          + ("  OK" if max_diff < 1e-4 else "  MISMATCH"))
    print()
    rows = []
    for n in VARIANTS:
        ph = result["phase_ms"][n]
        r = f"{ratio[n]:.3f}" if n != "ddp" else "1.000"
        pr = f"{paired[n]:.3f}" if n != "ddp" else "-"
        br = f"{best_ratio[n]:.3f}" if n != "ddp" else "-"
        ok = ("ok" if ratio[n] <= TARGET_RATIO else "ABOVE") if n != "ddp" else "ref"
        rows.append([n, f"{med[n]:.1f}", f"{min(blocks[n]):.1f}", f"{max(blocks[n]):.1f}", r, pr, br,
                     f"{ph['forward']:.1f}", f"{ph['backward']:.1f}", f"{ph['optimizer']:.1f}", ok])
    print(_common.table(["variant", "ms/step", "min", "max", "vs DDP", "paired", "min/min", "fwd", "bwd+comm", "opt",
                         f"<= {TARGET_RATIO}"], rows))
    print(f"(median over {result['rounds']} blocks of {args.block} steps; fwd/bwd+comm/opt: mean ms per step, "
          f"mean over ranks; nnscaler reducer buckets: {result['info']['nnscaler_buckets']})")
    print("vs DDP: ratio of medians (headline); paired: median of per-round ratios; min/min: ratio of best blocks")
    print(f"load average before/after: {load_before} / {load_after}; total wall time {wall:.1f} s")

    data = {
        **_common.run_header(),
        "config": {"nproc": args.nproc, "threads_per_rank": args.threads, "backend": "gloo",
                   "model": {"n_layer": args.layers, "n_embd": args.embd, "n_head": args.heads,
                             "block_size": args.block_size, "vocab_size": args.vocab, "use_sdpa": False,
                             "params": result["info"]["params"]},
                   "batch_per_rank": args.batch, "global_batch": result["info"]["global_batch"],
                   "optimizer": f"Adam(lr={args.lr})", "bucket_cap_mb": args.bucket_mb,
                   "ddp_bucket_cap_mb": args.ddp_bucket_mb,
                   "ddp_broadcast_buffers": args.ddp_broadcast_buffers,
                   "warmup_steps": args.warmup, "timed_steps_per_variant": result["rounds"] * args.block,
                   "block_steps": args.block, "rounds": result["rounds"]},
        "median_ms_per_step": med,
        "ratio_vs_ddp": ratio,
        "paired_ratio_vs_ddp": paired,
        "best_block_ratio_vs_ddp": best_ratio,
        "min_ms_per_step": {n: min(blocks[n]) for n in VARIANTS},
        "loadavg_before_after": [load_before, load_after],
        "target_ratio": TARGET_RATIO,
        "per_block_ms": blocks,
        "phase_ms_per_step": result["phase_ms"],
        "nnscaler_reducer": {"buckets": result["info"]["nnscaler_buckets"], **result["reducer_stats"]},
        "loss_check": {"step0": loss0, "warmup_losses": losses, "max_abs_diff_vs_ddp": max_diff},
        "wall_seconds": wall,
    }
    _common.save_results(args.out, data)
    if result.get("profiles"):
        for n, text in result["profiles"].items():
            print(f"\n===== cProfile rank 0, {args.profile_steps} steps of {n} (sorted by tottime) =====")
            print(text)


if __name__ == "__main__":
    main()
