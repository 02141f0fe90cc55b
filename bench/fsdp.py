"""Fully sharded data parallelism: nnscaler `use_zero=3` against torch FSDP2, DDP and ZeRO-1.

    python bench/fsdp.py [--layers 8] [--embd 640] [--steps 5] [--budget-mib 1400]

Every case trains the example GPT (examples/gpt.py, seed-0 weights, no SDPA) with Adam (lr 1e-3,
fp32) on 2 gloo processes (`--nproc`) of this machine, each with max(1, cores // nproc) intra-op
threads, on the same per-rank batches (rank r takes rows [r*B, (r+1)*B) of the global batch of
step s, `random_batch`):

* `ddp`    : `torch.nn.parallel.DistributedDataParallel` (25 MB buckets, `gradient_as_bucket_view`
             False as by default; no buffer broadcast: the buffers are constant causal masks) +
             `torch.optim.Adam`;
* `fsdp2`  : torch FSDP2, `torch.distributed.fsdp.fully_shard` on each block `h.i`, then on the
             root (defaults: `reshard_after_forward=True` for the blocks, the root kept gathered
             between forward and backward as FSDP2 does for the root) + `torch.optim.Adam`;
* `zero1`  : `nnscaler.parallelize(model, batch, 'dp', ComputeConfig(1, n, use_zero=True))` +
             `nnscaler.build_optimizer(pm, torch.optim.Adam)`;
* `zero3`  : the same with `use_zero=3` (each block `h.i` one unit, the rest the root unit).

Each case runs in fresh processes (one `torch.multiprocessing.spawn` per case), so a case's memory
is its own. Per case: build (model, wrapper, optimizer; the single-device model is dropped),
`--warmup` (2) untimed steps, then `--steps` (5) timed steps (`zero_grad`, forward, backward,
`step`; a barrier before each step; a step's time is that of the slower rank; reported: the
median over the steps).

**Memory.** The workers run with glibc's `MALLOC_MMAP_THRESHOLD_=65536` and
`MALLOC_TRIM_THRESHOLD_=131072` (set in the parent before the spawn: glibc reads them when a process
starts), so every tensor above 64 KiB is its own mapping, returned to the OS when freed, and RSS
follows the live tensors (by default glibc keeps freed heap memory and a freed gathered block or the
freed full model would stay in RSS). After the warm-up steps each rank runs `gc.collect()` and
`malloc_trim(0)`, resets its peak RSS (`echo 5 > /proc/self/clear_refs`: VmHWM := VmRSS) and reads
VmHWM after the timed steps: the **steady-state peak RSS** of training, without the one-off build
(which holds the whole single-device model on every rank; its peak, VmHWM before the reset, is
reported apart as `build_peak`). Also per rank: the RSS after `import torch` + gloo init, before any
model exists (`baseline`, the same for every case: torch, gloo, nnscaler), the peak above that
baseline, and the bytes of the tensors held between steps (parameters, gradients, optimizer state,
ZeRO-3 shards, nnscaler's reducer buffers; distinct storages; FSDP2's local shards; DDP's C++
gradient buckets, another 4 Psi, are not reachable from Python and not counted).

Targets (the slower/larger rank of each case): peak RSS zero3 / fsdp2 <= 1.05, zero3 / ddp <= 0.6,
step time zero3 / fsdp2 <= 1.0. Correctness: same initial weights and batches, so the mean loss
over ranks of every step must agree with DDP's (relative difference <= `--loss-rtol`, 1e-3).

**Memory budget.** Then `--budget-cases` (ddp zero1 zero3) train a larger GPT (`--demo-layers`,
`--demo-embd`) under a per-process budget of `--budget-mib` MiB of RSS: a thread samples VmRSS every
2 ms and VmHWM (reset after the build, as above) is read after every step; when a rank is over the
budget the ranks stop together after that step (an out-of-memory in a real run) and the case is
reported as not fitting, with the step and the peak; otherwise it trains `--budget-steps` steps and
fits. The build is outside the budget (every case builds the whole model first; `build_peak` is
reported).

Writes bench/results/fsdp.json.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

_common.add_examples_to_path()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

CASES = ("ddp", "fsdp2", "zero1", "zero3")
LABELS = {"ddp": "torch DDP", "fsdp2": "torch FSDP2 (fully_shard)", "zero1": "nnscaler use_zero=True (ZeRO-1)",
          "zero3": "nnscaler use_zero=3"}
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "131072"}
TARGETS = {"mem_zero3_vs_fsdp2": 1.05, "mem_zero3_vs_ddp": 0.6, "time_zero3_vs_fsdp2": 1.0}
MIB = 1 << 20
_fmt = _common.fmt_bytes


# -- per-process memory ---------------------------------------------------------------------------

def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _release() -> None:
    """Collect garbage and hand glibc's free memory back (the peak is reset just after)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def _reset_peak() -> int:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    return _status("VmRSS")


class _Sampler:
    """VmRSS every `period` seconds in a thread (the budget check; VmHWM is the exact peak)."""

    def __init__(self, period: float = 0.002):
        self.period, self.peak, self._stop = period, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, _status("VmRSS"))
            time.sleep(self.period)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def _held_bytes(model, opt) -> int:
    """Bytes of the distinct storages of parameters, gradients, optimizer state, ZeRO-3 shards and
    nnscaler reducer buffers (FSDP2: the local shards of its DTensors)."""
    seen = {}

    def add(t):
        if t is None or not torch.is_tensor(t):
            return
        t = getattr(t, "_local_tensor", t)  # DTensor
        s = t.untyped_storage()
        if s.nbytes():
            seen[(s.data_ptr(), s.nbytes())] = s.nbytes()

    for p in model.parameters():
        add(p)
        add(p.grad)
    for g in opt.param_groups:
        for p in g["params"]:
            add(p)
            add(p.grad)
    for st in opt.state.values():
        for v in st.values():
            add(v)
    for m in model.modules():
        fs = getattr(m, "fully_sharded", None)
        if fs is not None:
            for u in fs.units:
                add(u.shard)
                add(None if u.shard is None else u.shard.grad)
        reducer = getattr(m, "reducer", None)
        for b in getattr(reducer, "_buckets", None) or []:
            add(getattr(b, "buffer", None))
    return sum(seen.values())


# -- one case in one process ----------------------------------------------------------------------

def _gpt_cfg(a: dict):
    from gpt import GPTConfig
    return GPTConfig(vocab_size=a["vocab"], block_size=a["block_size"], n_layer=a["layers"], n_head=a["heads"],
                     n_embd=a["embd"], use_sdpa=False)


def _batches(a: dict, rank: int, world: int, steps: int):
    from gpt import random_batch
    cfg, per = _gpt_cfg(a), a["batch"]
    out = []
    for s in range(steps):
        full = random_batch(s, per * world, cfg)
        out.append({k: v[rank * per:(rank + 1) * per].contiguous() for k, v in full.items()})
    return out


def _build(case: str, a: dict, rank: int, world: int, gen_dir: str, example: dict):
    """(model, optimizer, parameters of the single-device model)."""
    import inspect
    from gpt import GPT
    torch.manual_seed(0)
    base = GPT(_gpt_cfg(a))
    n_params = sum(p.numel() for p in base.parameters())
    lr = a["lr"]
    if case == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        kw = {}
        if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters:
            kw["forward_sync_buffers"] = False
        else:
            kw["broadcast_buffers"] = False
        model = DDP(base, **kw)
        opt = torch.optim.Adam(model.parameters(), lr=lr)
    elif case == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        for block in base.h:
            fully_shard(block)
        model = fully_shard(base)
        opt = torch.optim.Adam(model.parameters(), lr=lr)
    else:
        from nnscaler import ComputeConfig, build_optimizer, parallelize
        cc = ComputeConfig(1, world, use_zero=3 if case == "zero3" else True, trace_strategy="cpu")
        model = parallelize(base, example, "dp", cc, gen_savedir=gen_dir, instance_name=f"{case}_{a['tag']}",
                            reuse="override")
        opt = build_optimizer(model, torch.optim.Adam, lr=lr)
    del base
    return model, opt, n_params


def _step(model, opt, b):
    opt.zero_grad()
    loss = model(**b)
    loss.backward()
    opt.step()
    return loss.detach()


def _mean_over_ranks(x: float, world: int) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / world


def _max_over_ranks(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def run_case(rank: int, case: str, a: dict, gen_dir: str, budget: int = 0) -> dict:
    """Build, warm up, then time `a['steps']` steps with the peak RSS reset after the warm-up.
    With `budget` (bytes): stop (all ranks) after the first step whose peak RSS exceeds it."""
    world = dist.get_world_size()
    dist.barrier()
    _release()
    baseline = _status("VmRSS")
    nsteps = a["warmup"] + a["steps"]
    batches = _batches(a, rank, world, nsteps)
    t0 = time.perf_counter()
    model, opt, n_params = _build(case, a, rank, world, gen_dir, batches[0])
    _release()
    build_s = time.perf_counter() - t0
    build_peak = _status("VmHWM")
    losses, times = [], []
    for s in range(a["warmup"]):
        losses.append(_mean_over_ranks(_step(model, opt, batches[s]).item(), world))
    _release()
    dist.barrier()
    held = _held_bytes(model, opt)
    reset_rss = _reset_peak()
    sampler = _Sampler()
    over_at, peaks = None, []
    for s in range(a["warmup"], nsteps):
        dist.barrier()
        t = time.perf_counter()
        loss = _step(model, opt, batches[s])
        times.append(_max_over_ranks(time.perf_counter() - t))
        losses.append(_mean_over_ranks(loss.item(), world))
        peaks.append(max(_status("VmHWM"), sampler.peak))
        if budget and _max_over_ranks(float(peaks[-1] > budget)):
            over_at = s - a["warmup"]
            break
    sampled = sampler.stop()
    peak = max(_status("VmHWM"), sampled)
    stats = getattr(getattr(model, "fully_sharded", None), "stats", None)
    out = {"rank": rank, "case": case, "params": n_params, "baseline_rss": baseline, "build_peak": build_peak,
           "build_s": build_s, "held_bytes": held, "reset_rss": reset_rss, "peak_rss": peak,
           "sampled_peak_rss": sampled, "peak_per_step": peaks, "peak_above_baseline": peak - baseline,
           "step_s": times, "losses": losses, "over_budget_at_step": over_at,
           "zero3_stats": None if stats is None else dict(vars(stats))}
    del model, opt
    dist.barrier()
    return out


# -- driver ---------------------------------------------------------------------------------------

def spawn_case(case: str, a: dict, tmp: str, budget: int = 0):
    old = {k: os.environ.get(k) for k in MALLOC_ENV}
    if a["malloc_env"]:
        os.environ.update(MALLOC_ENV)  # read by glibc at start: the workers inherit it
    try:
        ranks, spawn_s = _common.spawn_gloo(run_case, (case, a, os.path.join(tmp, "gen"), budget), a["nproc"],
                                            os.path.join(tmp, f"{case}_{a['tag']}.json"))
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return ranks, spawn_s


def summarize(case: str, ranks: list, spawn_s: float) -> dict:
    r0 = ranks[0]
    return {"case": case, "label": LABELS[case], "params": r0["params"], "spawn_s": spawn_s,
            "peak_rss": max(r["peak_rss"] for r in ranks), "baseline_rss": max(r["baseline_rss"] for r in ranks),
            "peak_above_baseline": max(r["peak_above_baseline"] for r in ranks),
            "build_peak": max(r["build_peak"] for r in ranks), "held_bytes": max(r["held_bytes"] for r in ranks),
            "step_s_median": statistics.median(r0["step_s"]) if r0["step_s"] else float("nan"),
            "step_s": r0["step_s"], "losses": r0["losses"], "over_budget_at_step": r0["over_budget_at_step"],
            "per_rank": ranks}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--cases", nargs="*", default=list(CASES), choices=CASES)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--embd", type=int, default=640)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--batch", type=int, default=2, help="sequences per rank")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--loss-rtol", type=float, default=1e-3)
    p.add_argument("--no-malloc-env", action="store_true", help="leave glibc's malloc defaults in the workers")
    p.add_argument("--budget-cases", nargs="*", default=["ddp", "zero1", "zero3"], choices=CASES)
    p.add_argument("--budget-mib", type=float, default=1400)
    p.add_argument("--demo-layers", type=int, default=12)
    p.add_argument("--demo-embd", type=int, default=768)
    p.add_argument("--budget-steps", type=int, default=3)
    p.add_argument("--out", default=str(_common.RESULTS_DIR / "fsdp.json"))
    args = _common.parse_args(p, {"layers": 2, "embd": 64, "heads": 2, "block_size": 16, "batch": 2, "warmup": 1,
                                  "steps": 2, "demo_layers": 2, "demo_embd": 64, "budget_steps": 1},
                              "fsdp.json")
    t_start = time.perf_counter()
    load_before = _common.loadavg()
    a = {"vocab": args.vocab, "block_size": args.block_size, "layers": args.layers, "heads": args.heads,
         "embd": args.embd, "batch": args.batch, "lr": args.lr, "warmup": args.warmup, "steps": args.steps,
         "nproc": args.nproc, "malloc_env": not args.no_malloc_env, "tag": "main"}
    threads = _common.threads_per_rank(args.nproc)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for case in args.cases:
            ranks, spawn_s = spawn_case(case, a, tmp)
            results[case] = summarize(case, ranks, spawn_s)
            c = results[case]
            print(f"{case:6s}: peak RSS {c['peak_rss'] / MIB:8.1f} MiB, step {c['step_s_median'] * 1e3:8.1f} ms, "
                  f"loss {c['losses'][-1]:.6f} ({spawn_s:.1f} s)", flush=True)
        budget_runs = {}
        budget = int(args.budget_mib * MIB)
        demo = dict(a, layers=args.demo_layers, embd=args.demo_embd, warmup=1, steps=args.budget_steps, tag="demo")
        for case in args.budget_cases:
            ranks, spawn_s = spawn_case(case, demo, tmp, budget)
            budget_runs[case] = summarize(case, ranks, spawn_s)
            c = budget_runs[case]
            print(f"budget {case:6s}: peak RSS {c['peak_rss'] / MIB:8.1f} MiB, over at {c['over_budget_at_step']} "
                  f"({spawn_s:.1f} s)", flush=True)
    print(results.keys(), budget_runs.keys(), time.perf_counter() - t_start, load_before)


if __name__ == "__main__":
    main()
