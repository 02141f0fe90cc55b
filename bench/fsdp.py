"""Fully sharded data parallelism: nnscaler `use_zero=3` against torch FSDP2, DDP and nnscaler ZeRO-1.

    python bench/fsdp.py [--layers 10] [--embd 768] [--rounds 5] [--budget-mib 1100]

Every case trains the example GPT (examples/gpt.py, seed-0 weights, no SDPA, tied embedding and
head) with Adam (lr 1e-3, fp32) on `--nproc` (2) gloo processes of this machine, each with
max(1, cores // nproc) intra-op threads, on the same per-rank batches (rank r takes rows
[r*B, (r+1)*B) of the global batch of step s, `random_batch`):

* `ddp`   : `torch.nn.parallel.DistributedDataParallel` (25 MB buckets, `gradient_as_bucket_view`
            off as by default; no per-forward buffer broadcast: the buffers are constant causal
            masks) + `torch.optim.Adam`;
* `fsdp2` : torch FSDP2, `torch.distributed.fsdp.fully_shard` on each block `h.i`, then on the root
            (defaults: the blocks reshard after forward, the root stays gathered from forward to
            backward) + `torch.optim.Adam` over its DTensor parameters;
* `zero1` : `nnscaler.parallelize(model, batch, 'dp', ComputeConfig(1, n, use_zero=True))` +
            `nnscaler.build_optimizer(pm, torch.optim.Adam)`;
* `zero3` : the same with `use_zero=3` (each block `h.i` one unit, gathered on first use and freed
            after; embeddings, final norm and tied head the root unit).

A step is `zero_grad`, forward (the loss), backward, `step`.

**1. Step time** (one `torch.multiprocessing.spawn`, all the cases built in the same processes,
glibc's default malloc settings): `--warmup` (1) untimed step of each, then `--rounds` (5) rounds
in which each case runs a block of `--block` (1) steps, the order rotated every round, a barrier
before every block; a block's time is that of the slower rank. Interleaving keeps the cases
comparable while other jobs load the machine. Reported: the median ms/step over the blocks, the
ratio of the medians and the median of the per-round ratios ("paired"); forward / backward / step
ms of rank 0 (means).

**2. Memory** (one spawn per case, so a case's memory is its own): the workers run with glibc's
`MALLOC_MMAP_THRESHOLD_=65536` and `MALLOC_TRIM_THRESHOLD_=131072`, set in the parent before the
spawn (glibc reads them when a process starts; `--no-malloc-env` drops them): every allocation
above 64 KiB is its own mapping, unmapped when freed, so RSS follows the live tensors (with glibc's
defaults freed heap memory stays in RSS, so a freed gathered block or the freed single-device model
would count as held). Each rank records its RSS after `import torch` + gloo init (`cold baseline`)
and again after one Adam step of a tiny single-device GPT and one of each collective, released
(`baseline`: torch, gloo, nnscaler, code pages and thread pools, the same for every case, ~310 MiB
here; a 117k-parameter GPT's steady RSS is within 5 MiB of it), before any model; it then builds (single-device model,
wrapper, optimizer; the single-device model is dropped), runs `--mem-warmup` (1) steps (Adam's
state then exists), `gc.collect()` + `malloc_trim(0)`, resets its peak RSS
(`echo 5 > /proc/self/clear_refs`: VmHWM := VmRSS) and runs `--mem-steps` (3) steps; the
**steady-state peak RSS** is VmHWM after them (and at least the largest VmRSS a thread sampled
every 2 ms), so the one-off build, which holds the whole model on every rank, is excluded; its
peak (VmHWM before the reset) is reported apart as `build_peak`. Also per rank: the peak above
the baseline, the RSS at the reset (`steady`: what is held between steps) and the peak above it
(`transient`: what a step adds: gathered blocks, activations, communication buffers), and the
bytes of the tensors held between steps that Python can reach (parameters, gradients, optimizer
state, ZeRO-3 shards, nnscaler's reducer buffers: distinct storages; FSDP2's local shards; DDP's
C++ gradient buckets, another 4 Psi bytes, are not reachable). Each case's figure is its larger rank.

Targets: peak RSS zero3 / fsdp2 <= 1.05 and zero3 / ddp <= 0.6; step time zero3 / fsdp2 <= 1.0.
Correctness: same initial weights and batches, so the loss of every step (mean over the ranks) of
each case, in both parts, must match DDP's within `--loss-rtol` (1e-3, relative).

**3. Memory budget**: `--budget-cases` (ddp zero1 zero3) train a larger GPT (`--demo-layers` 10,
`--demo-embd` 768) in fresh processes under a per-process budget of `--budget-mib` MiB of RSS,
measured as in part 2 from the end of the build (no warm-up: Adam's state is created by the first
step, inside the budget): after every step the ranks compare their peak RSS (VmHWM, and the 2 ms
samples) with the budget; when one is over, all stop (what an out-of-memory would do) and the case
does not fit; otherwise it trains `--budget-steps` (3) steps and fits. The build is outside the
budget (each case builds the whole single-device model first; its peak is reported).

**4. Gradient accumulation** (`--parts accum`): `use_zero=3` with `--accum-micros` (4) micro-batches
a step of one sequence each, measured as in part 2, in two modes: `no_sync` (the micro-batches but
the last inside `model.no_sync()`: each unit's full gradients kept and summed, one reduce-scatter a
step) and `each` (every micro-batch reduce-scatters into the shard gradients): their peak RSS, step
time and reduce-scatters a step.

**5. Checkpoints** (`--parts ckpt`, `_fsdp_ckpt.py`): the RSS a `use_zero=3` rank adds while it
saves, loads and async-saves the shards as held, against the rank's shard (the bytes of its rank
file) and the writer's buffer, and the same save and load inside `unsharded()` (each rank holding
its whole local model) in the same run. Target: added <= 1.1 x shard + writer's buffer.

**6. Frozen parameters** (`--parts frozen`): `use_zero=3` and ZeRO-1 measured as in part 2 with
every parameter trainable and with the first `--frozen-blocks` (half the layers) blocks frozen
(``requires_grad_(False)``, as in partial fine-tuning): the memory the frozen tensors' missing
gradients and Adam state save, in the same run.

**7. Whole life** (`--parts life`, `_fsdp_life.py`): build on the meta device, load from a Hugging
Face directory, `--life-steps` (3) steps and save, on `--life-nproc` (4) `use_zero=3` ranks, against
one process doing the same from a CPU build (a ~99M-parameter transformers Llama): the worst rank's
peak RSS above its baseline against the one process's, per phase too. Target <= 0.35.

**8. What a user sees** (`--parts train`, `_fsdp_train.py`): `nnscaler train` of the example
`hf_llama.yaml` with a ~32M-parameter Llama on `--train-nproc` (2) processes, unsharded and
`use_zero: 3`, with the launcher's malloc thresholds and with glibc's defaults: each worker's peak
RSS, at set-up and in training.

`--parts time memory budget accum ckpt frozen life train` picks the parts (default all eight). Writes bench/results/fsdp.json.
"""
from __future__ import annotations

import argparse
import contextlib
import inspect
import os
import statistics
import sys
import tempfile
import time
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402
import _fsdp_ckpt  # noqa: E402
import _fsdp_life  # noqa: E402
import _fsdp_train  # noqa: E402
import _rss  # noqa: E402
from _common import MIB, fmt_mib  # noqa: E402

_common.add_examples_to_path()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

CASES = ("ddp", "fsdp2", "zero1", "zero3")
LABELS = {"ddp": "torch DDP", "fsdp2": "torch FSDP2 (fully_shard)", "zero1": "nnscaler use_zero=True (ZeRO-1)",
          "zero3": "nnscaler use_zero=3"}
TARGETS = {"peak_rss zero3/fsdp2": 1.05, "peak_rss zero3/ddp": 0.6, "step_time zero3/fsdp2": 1.0}

# -- building and stepping ------------------------------------------------------------------------

def _gpt_cfg(a: dict):
    from gpt import GPTConfig
    return GPTConfig(vocab_size=a["vocab"], block_size=a["block_size"], n_layer=a["layers"], n_head=a["heads"],
                     n_embd=a["embd"], use_sdpa=False)


def _batches(a: dict, rank: int, world: int, steps: int) -> list:
    from gpt import random_batch
    cfg, per = _gpt_cfg(a), a["batch"]
    out = []
    for s in range(steps):
        full = random_batch(s, per * world, cfg)
        out.append({k: v[rank * per:(rank + 1) * per].contiguous() for k, v in full.items()})
    return out


def _build(case: str, a: dict, world: int, gen_dir: str, example: dict):
    """(model, optimizer, parameters of the single-device model); the single-device model is
    not kept apart from what the wrapper holds."""
    from gpt import GPT
    torch.manual_seed(0)
    base = GPT(_gpt_cfg(a))
    n_params = sum(p.numel() for p in base.parameters())
    for block in base.h[:a.get("frozen_blocks", 0)]:  # part 6
        block.requires_grad_(False)
    if case == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        kw = ({"forward_sync_buffers": False} if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters
              else {"broadcast_buffers": False})
        model = DDP(base, **kw)
        opt = torch.optim.Adam(model.parameters(), lr=a["lr"])
    elif case == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        for block in base.h:
            fully_shard(block)
        model = fully_shard(base)
        opt = torch.optim.Adam(model.parameters(), lr=a["lr"])
    else:
        from nnscaler import ComputeConfig, build_optimizer, parallelize
        cc = ComputeConfig(1, world, use_zero=3 if case == "zero3" else True, trace_strategy="cpu")
        model = parallelize(base, example, "dp", cc, gen_savedir=gen_dir, instance_name=f"{case}_{a['tag']}",
                            reuse="override")
        opt = build_optimizer(model, torch.optim.Adam, lr=a["lr"])
    del base
    return model, opt, n_params


def _step(model, opt, b, phases=None, micros: int = 1, accum: str = "no_sync"):
    """One step; with `micros` > 1 the batch is cut into that many micro-batches, accumulated
    inside ``no_sync()`` but the last (`accum` "no_sync": full gradients kept, one reduction) or
    reduced each (`accum` "each")."""
    if micros <= 1:
        return _common.timed_step(model, opt, b, phases)
    t0 = time.perf_counter()
    opt.zero_grad()
    n = len(next(iter(b.values()))) // micros
    parts = [{k: v[i * n:(i + 1) * n] for k, v in b.items()} for i in range(micros)]
    for i, part in enumerate(parts):
        local = accum == "no_sync" and i < micros - 1
        with (model.no_sync() if local else contextlib.nullcontext()):
            (model(**part) / micros).backward()
    t1 = t2 = time.perf_counter()
    opt.step()
    if phases is not None:
        phases[0] += t1 - t0
        phases[2] += time.perf_counter() - t2
    return torch.zeros(())


# -- part 1: step time, every case in the same processes ------------------------------------------

def time_cases(rank: int, cases: list, a: dict, gen_dir: str) -> dict:
    world = dist.get_world_size()
    nsteps = a["warmup"] + a["rounds"] * a["block"]
    batches = _batches(a, rank, world, nsteps)
    built, build_s = {}, {}
    for c in cases:
        t0 = time.perf_counter()
        built[c] = _build(c, a, world, gen_dir, batches[0])[:2]
        build_s[c] = time.perf_counter() - t0
        _rss.release()
    done = {c: 0 for c in cases}
    losses = {c: [] for c in cases}
    phases = {c: [0.0, 0.0, 0.0] for c in cases}

    def run(c, n, ph=None):
        out = []
        for _ in range(n):
            out.append(_step(*built[c], batches[done[c]], ph))
            done[c] += 1
        return out

    for c in cases:
        for x in run(c, a["warmup"]):
            losses[c].append(x.item())
    times, rounds = _common.interleaved_rounds(cases, a["rounds"], a["block"],
                                               lambda c: run(c, a["block"], phases[c]), losses)
    for c in cases:
        losses[c] = [x / world for x in _common.all_reduce_floats(losses[c])]
    stats = {c: dict(vars(built[c][0].fully_sharded.stats)) for c in cases
             if getattr(built[c][0], "fully_sharded", None) is not None}
    nsteps_timed = a["rounds"] * a["block"]
    return {"rank": rank, "build_s": build_s, "step_s": times, "rounds": rounds, "losses": losses,
            "phases_ms": {c: [1e3 * x / nsteps_timed for x in ph] for c, ph in phases.items()},
            "zero3_stats": stats}


# -- parts 2 and 3: memory of one case in its own processes ----------------------------------------

WARM_UP_COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")  # those the cases use


def _tiny_step() -> None:
    """One Adam step of a tiny single-device GPT (2 x 64): `_rss.baselines`' warm-up."""
    from gpt import GPT, GPTConfig, random_batch
    cfg = GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=64)
    torch.manual_seed(1)
    m = GPT(cfg)
    o = torch.optim.Adam(m.parameters(), lr=1e-3)
    m(**random_batch(0, 2, cfg)).backward()
    o.step()


def _reduce_scatters(sharded) -> Optional[int]:
    return sharded.stats.reduce_scatters if sharded is not None else None


def _rss_parts() -> dict:
    return {k: _rss.status(k) for k in ("RssAnon", "RssFile", "RssShmem")}


def memory_case(rank: int, case: str, a: dict, gen_dir: str, budget: int = 0) -> dict:
    """Build, `mem_warmup` steps, reset the peak RSS, `mem_steps` steps. With `budget` (bytes): all
    ranks stop after the first step whose peak RSS is over it on some rank."""
    world = dist.get_world_size()
    baseline_cold, baseline = _rss.baselines(_tiny_step, WARM_UP_COLLECTIVES)
    nsteps = a["mem_warmup"] + a["mem_steps"]
    batches = _batches(a, rank, world, nsteps)
    t0 = time.perf_counter()
    model, opt, n_params = _build(case, a, world, gen_dir, batches[0])
    build_s = time.perf_counter() - t0

    def step(s):
        return _step(model, opt, batches[s], micros=a.get("micros", 1), accum=a.get("accum")).item()
    losses = [step(s) for s in range(a["mem_warmup"])]
    _rss.release()
    build_peak = _rss.status("VmHWM")
    held = _rss.held_bytes(model, opt) if a["mem_warmup"] else None  # grads and Adam state exist after a step
    dist.barrier()
    steady_parts = _rss_parts()
    m = _rss.steady_state_peak(step, range(a["mem_warmup"], nsteps), budget)
    end_parts = _rss_parts()
    if held is None:
        held = _rss.held_bytes(model, opt)
    model_stats = getattr(model, "fully_sharded", None)
    losses = [x / world for x in _common.all_reduce_floats(losses + m.losses)]
    del model, opt
    dist.barrier()
    return {"rank": rank, "case": case, "params": n_params, "baseline_cold_rss": baseline_cold,
            "baseline_rss": baseline, "build_peak": build_peak, "steady_rss_parts": steady_parts,
            "end_rss_parts": end_parts,
            "build_s": build_s, "held_bytes": held, "steady_rss": m.steady, "peak_rss": m.peak,
            "sampled_peak_rss": m.sampled, "peak_rss_per_step": m.per_step, "peak_above_baseline": m.peak - baseline,
            "transient": m.peak - m.steady, "step_s": m.step_s, "losses": losses,
            "over_budget_at_step": m.over_budget_at_step, "reduce_scatters": _reduce_scatters(model_stats)}


def ckpt_case(rank: int, a: dict, gen_dir: str, out_dir: str) -> dict:
    """Part 5: build `use_zero=3`, one step (Adam's state then exists), then `_fsdp_ckpt.measure`."""
    world = dist.get_world_size()
    _rss.baselines(_tiny_step, WARM_UP_COLLECTIVES)
    batches = _batches(a, rank, world, 1)
    model, opt, n_params = _build("zero3", a, world, gen_dir, batches[0])
    _step(model, opt, batches[0])
    opt.zero_grad()
    return {"params": n_params, **_fsdp_ckpt.measure(model, opt, out_dir)}


# -- driver ---------------------------------------------------------------------------------------

def _spawn(fn, fn_args: tuple, a: dict, tmp: str, name: str, malloc_env: bool):
    return _rss.spawn(fn, fn_args, a["nproc"], os.path.join(tmp, name + ".json"), malloc_env)


def _mem_summary(case: str, ranks: list, spawn_s: float) -> dict:
    return _rss.mem_summary(case, LABELS[case], ranks, spawn_s, rank0_keys=("params", "over_budget_at_step"))


def _life(args, tmp: str) -> dict:
    """Part 7: the Hugging Face directory, then the use_zero=3 ranks and the one process."""
    c = _fsdp_life.config(args)
    hf_dir = os.path.join(tmp, "life_hf")
    n_params = _fsdp_life.write_hf_directory(c, hf_dir)
    _rss.release()
    out, gen = os.path.join(tmp, "life_ckpt"), os.path.join(tmp, "life_gen")
    os.makedirs(out, exist_ok=True)
    malloc = not args.no_malloc_env
    zero3, s3 = _rss.spawn(_fsdp_life.zero3_case, (c, hf_dir, gen, out), c["nproc"], os.path.join(tmp, "life3.json"),
                           malloc)
    print(f"part 7 (whole life) use_zero=3 x {c['nproc']}: {s3:.1f} s", flush=True)
    single, s1 = _rss.spawn(_fsdp_life.single_case, (c, hf_dir, out), 1, os.path.join(tmp, "life1.json"), malloc)
    print(f"part 7 (whole life) one process: {s1:.1f} s", flush=True)
    return _fsdp_life.summary(zero3, single[0], {"zero3": s3, "single": s1}, n_params, args.loss_rtol)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--cases", nargs="*", default=list(CASES), choices=CASES)
    p.add_argument("--layers", type=int, default=10)
    p.add_argument("--embd", type=int, default=768)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--batch", type=int, default=2, help="sequences per rank")
    p.add_argument("--lr", type=float, default=1e-3)
    _rss.add_protocol_args(p, warmup=1, rounds=5, block=1)
    parts = ["time", "memory", "budget", "accum", "ckpt", "frozen", "life", "train"]
    p.add_argument("--parts", nargs="*", default=parts, choices=parts,
                   help="which parts to run (1: time, 2: memory, 3: budget, 4: accum, 5: ckpt, 6: frozen, 7: life, 8: train)")
    p.add_argument("--frozen-blocks", type=int, default=None, help="part 6: blocks frozen (default: half)")
    p.add_argument("--frozen-cases", nargs="*", default=["zero3", "zero1"], choices=["zero3", "zero1"])
    p.add_argument("--accum-micros", type=int, default=4, help="part 4: micro-batches a step")
    p.add_argument("--budget-cases", nargs="*", default=["ddp", "zero1", "zero3"], choices=CASES)
    p.add_argument("--budget-mib", type=float, default=1100)
    p.add_argument("--demo-layers", type=int, default=10)
    p.add_argument("--demo-embd", type=int, default=768)
    p.add_argument("--budget-steps", type=int, default=3)
    _fsdp_life.add_args(p)
    _fsdp_train.add_args(p)
    p.add_argument("--out", default=str(_common.RESULTS_DIR / "fsdp.json"))
    args = _common.parse_args(p, {"layers": 2, "embd": 64, "heads": 2, "block_size": 16, "warmup": 1, "rounds": 1,
                                  "mem_steps": 1, "demo_layers": 2, "demo_embd": 64, "budget_steps": 1,
                                  "accum_micros": 2,
                                  # few process launches (the test suite's time): budget and accumulation run the
                                  # worker the frozen part runs (memory_case), with other arguments
                                  "cases": ["ddp", "fsdp2", "zero3"],
                                  "parts": ["time", "ckpt", "frozen", "life", "train"],
                                  "frozen_cases": ["zero3"], "budget_cases": ["zero3"], **_fsdp_life.SMOKE,
                                  **_fsdp_train.SMOKE},
                              "fsdp.json")
    t_start = time.perf_counter()
    load_before = _common.loadavg()
    cases = list(args.cases)
    a = {"vocab": args.vocab, "block_size": args.block_size, "layers": args.layers, "heads": args.heads,
         "embd": args.embd, "batch": args.batch, "lr": args.lr, "warmup": args.warmup, "rounds": args.rounds,
         "block": args.block, "mem_warmup": args.mem_warmup, "mem_steps": args.mem_steps, "nproc": args.nproc,
         "tag": "main"}
    threads = _common.threads_per_rank(args.nproc)
    print(f"GPT {args.layers} layers x {args.embd}, {args.heads} heads, T {args.block_size}, vocab {args.vocab}, "
          f"{args.batch} sequences per rank; {args.nproc} gloo processes x {threads} thread(s)", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        gen = os.path.join(tmp, "gen")
        timing, time_spawn_s = ([], 0.0)
        if cases and "time" in args.parts:
            timing, time_spawn_s = _spawn(time_cases, (cases, a, gen), a, tmp, "time", False)
            print(f"part 1 (step time, interleaved): {time_spawn_s:.1f} s", flush=True)
        mem = {}
        for c in (cases if "memory" in args.parts else []):
            ranks, s = _spawn(memory_case, (c, a, gen), a, tmp, f"mem_{c}", not args.no_malloc_env)
            mem[c] = _mem_summary(c, ranks, s)
            print(f"part 2 (memory) {c}: peak RSS {fmt_mib(mem[c]['peak_rss'])} MiB ({s:.1f} s)", flush=True)
        budget = int(args.budget_mib * MIB)
        demo = dict(a, layers=args.demo_layers, embd=args.demo_embd, mem_warmup=0, mem_steps=args.budget_steps,
                    tag="demo")
        budget_runs = {}
        for c in (args.budget_cases if "budget" in args.parts else []):
            ranks, s = _spawn(memory_case, (c, demo, gen, budget), demo, tmp, f"budget_{c}", not args.no_malloc_env)
            budget_runs[c] = _mem_summary(c, ranks, s)
            print(f"part 3 (budget) {c}: peak RSS {fmt_mib(budget_runs[c]['peak_rss'])} MiB ({s:.1f} s)", flush=True)

        accum_runs = {}
        for mode in (("no_sync", "each") if "accum" in args.parts else ()):
            acc = dict(a, batch=args.accum_micros, micros=args.accum_micros, accum=mode, tag="accum")
            ranks, s = _spawn(memory_case, ("zero3", acc, gen), acc, tmp, f"accum_{mode}", not args.no_malloc_env)
            accum_runs[mode] = _mem_summary("zero3", ranks, s)
            accum_runs[mode]["reduce_scatters_per_step"] = ranks[0]["reduce_scatters"] / (acc["mem_warmup"]
                                                                                      + acc["mem_steps"])
            print(f"part 4 (accumulation, {mode}) zero3: peak RSS {fmt_mib(accum_runs[mode]['peak_rss'])} MiB "
                  f"({s:.1f} s)", flush=True)

        ckpt_run = None
        if "ckpt" in args.parts:
            ranks, s = _spawn(ckpt_case, (a, gen, os.path.join(tmp, "ckpt")), a, tmp, "ckpt", not args.no_malloc_env)
            ckpt_run = _fsdp_ckpt.summary(ranks)
            print(f"part 5 (checkpoints) zero3: ({s:.1f} s)", flush=True)
        frozen_runs = {}
        n_frozen = args.layers // 2 if args.frozen_blocks is None else args.frozen_blocks
        for c in (args.frozen_cases if "frozen" in args.parts else ()):
            for k in (0, n_frozen):
                fa = dict(a, frozen_blocks=k, tag=f"frozen{k}")
                ranks, s = _spawn(memory_case, (c, fa, gen), fa, tmp, f"frozen_{c}_{k}", not args.no_malloc_env)
                frozen_runs[f"{c} frozen {k}"] = dict(_mem_summary(c, ranks, s), frozen_blocks=k)
                print(f"part 6 (frozen) {c}, {k} blocks frozen: peak RSS "
                      f"{fmt_mib(frozen_runs[f'{c} frozen {k}']['peak_rss'])} MiB ({s:.1f} s)", flush=True)
        life = _life(args, tmp) if "life" in args.parts else None
        train = _fsdp_train.run(args, tmp) if "train" in args.parts else None

    # -- report ------------------------------------------------------------------------------------
    r0 = timing[0] if timing else None
    step = {c: statistics.median(r0["step_s"][c]) for c in cases} if r0 else {}
    ref = "ddp" if "ddp" in cases else (cases[0] if cases else None)
    checks = {}
    for c in cases:
        diffs = []
        x = {}
        if r0:
            x["loss_rel_diff_vs_ddp_time"] = _common.max_rel_diff(r0["losses"][c], r0["losses"][ref])
            x["losses_time"] = r0["losses"][c]
            diffs.append(x["loss_rel_diff_vs_ddp_time"])
        if mem:
            x["loss_rel_diff_vs_ddp_mem"] = _common.max_rel_diff(mem[c]["losses"], mem[ref]["losses"])
            diffs.append(x["loss_rel_diff_vs_ddp_mem"])
        x["losses"] = r0["losses"][c] if r0 else mem[c]["losses"] if mem else []
        x["max_rel_diff"] = max(diffs) if diffs else None
        x["ok"] = not diffs or x["max_rel_diff"] <= args.loss_rtol
        checks[c] = x
    for c, b in budget_runs.items():
        bref = "ddp" if "ddp" in budget_runs else next(iter(budget_runs))
        b["loss_rel_diff_vs_ddp"] = _common.max_rel_diff(b["losses"], budget_runs[bref]["losses"])
        b["fits"] = b["over_budget_at_step"] is None

    params = (mem[cases[0]]["params"] if mem else None) if cases else None
    print(f"\n== GPT {args.layers} x {args.embd}" + (f": {params:,} parameters" if params else "")
          + f", Adam fp32, {args.nproc} gloo ranks x {threads} thread(s) ==")
    rows = []
    for c in cases:
        m = mem.get(c, {})
        row = [c]
        if mem:
            row += [fmt_mib(m[k]) for k in ("baseline_cold_rss", "baseline_rss", "build_peak", "held_bytes",
                                            "steady_rss", "transient", "peak_rss", "peak_above_baseline")]
        if r0:
            ph = r0["phases_ms"][c]
            row += [f"{step[c] * 1e3:,.0f}", f"{min(r0['step_s'][c]) * 1e3:,.0f}",
                    f"{ph[0]:,.0f} / {ph[1]:,.0f} / {ph[2]:,.0f}"]
        row += [f"{checks[c]['losses'][-1]:.6f}" if checks[c]["losses"] else "-",
                "-" if checks[c]["max_rel_diff"] is None else f"{checks[c]['max_rel_diff']:.1e}"]
        rows.append(row)
    if rows and (mem or r0):
        head = ["case"]
        if mem:
            head += ["cold baseline MiB", "baseline", "build peak", "held tensors", "steady RSS", "transient",
                     "peak RSS", "peak - baseline"]
        if r0:
            head += ["step ms (median)", "min", "fwd / bwd / opt ms"]
        head += ["final loss", "loss rel diff vs DDP"]
        print(_common.table(head, rows))
        if mem:
            print("RSS in MiB, per case its larger rank. cold baseline: after import + gloo init; baseline: then after "
                  "one step of a tiny GPT (code pages, thread pools); steady: at the reset after the warm-up; "
                  "transient = peak - steady; held tensors = params + grads + optimizer state (+ ZeRO-3 shards, "
                  "nnscaler reducer buffers; not DDP's C++ buckets)")
    ratios = {}
    if {"zero3", "fsdp2"} <= set(cases):
        if mem:
            ratios["peak_rss zero3/fsdp2"] = mem["zero3"]["peak_rss"] / mem["fsdp2"]["peak_rss"]
            ratios["peak_above_baseline zero3/fsdp2"] = (mem["zero3"]["peak_above_baseline"]
                                                         / mem["fsdp2"]["peak_above_baseline"])
        if r0:
            ratios["step_time zero3/fsdp2"] = step["zero3"] / step["fsdp2"]
            ratios["step_time zero3/fsdp2 (paired)"] = statistics.median(
                rd["zero3"] / rd["fsdp2"] for rd in r0["rounds"])
    if {"zero3", "ddp"} <= set(cases):
        if mem:
            ratios["peak_rss zero3/ddp"] = mem["zero3"]["peak_rss"] / mem["ddp"]["peak_rss"]
            ratios["peak_above_baseline zero3/ddp"] = (mem["zero3"]["peak_above_baseline"]
                                                       / mem["ddp"]["peak_above_baseline"])
        if r0:
            ratios["step_time zero3/ddp"] = step["zero3"] / step["ddp"]
    if {"zero1", "ddp"} <= set(cases) and mem:
        ratios["peak_rss zero1/ddp"] = mem["zero1"]["peak_rss"] / mem["ddp"]["peak_rss"]
    if {"fsdp2", "ddp"} <= set(cases) and mem:
        ratios["peak_rss fsdp2/ddp"] = mem["fsdp2"]["peak_rss"] / mem["ddp"]["peak_rss"]
    if ratios:
        print()
        print(_common.table(["ratio", "value", "target", "met"],
                            [[k, f"{v:.3f}", f"<= {TARGETS[k]}" if k in TARGETS else "-",
                              ("yes" if v <= TARGETS[k] else "NO") if k in TARGETS else "-"]
                             for k, v in ratios.items()]))
    if budget_runs:
        any_b = next(iter(budget_runs.values()))
        print(f"\n== budget {args.budget_mib:,.0f} MiB RSS per process: GPT {args.demo_layers} x {args.demo_embd}, "
              f"{any_b['params']:,} parameters (the build is outside the budget) ==")
        print(_common.table(
            ["case", "baseline MiB", "build peak", "peak RSS (training)", "budget", "fits",
             "steps trained", "loss rel diff vs DDP"],
            [[c, fmt_mib(b["baseline_rss"]), fmt_mib(b["build_peak"]), fmt_mib(b["peak_rss"]), fmt_mib(budget),
              "yes" if b["fits"] else "NO", f"{len(b['per_rank'][0]['step_s'])} of {args.budget_steps}"
              + ("" if b["fits"] else f" (over at step {b['over_budget_at_step']})"),
              f"{b['loss_rel_diff_vs_ddp']:.1e}"] for c, b in budget_runs.items()]))
    if accum_runs:
        print(f"\n== gradient accumulation under use_zero=3: {args.accum_micros} micro-batches a step "
              f"(GPT {args.layers} x {args.embd}) ==")
        print(_common.table(
            ["mode", "steady RSS", "peak RSS", "transient", "reduce-scatters a step", "step ms (median)"],
            [[m, fmt_mib(r["steady_rss"]), fmt_mib(r["peak_rss"]), fmt_mib(r["transient"]),
              f"{r['reduce_scatters_per_step']:.0f}", f"{r['step_s_median'] * 1e3:,.0f}"]
             for m, r in accum_runs.items()]))
    if frozen_runs:
        print(f"\n== frozen parameters: the first {n_frozen} of {args.layers} blocks frozen (GPT {args.layers} x "
              f"{args.embd}, Adam) ==")
        rows = []
        for c in args.frozen_cases:
            full, part = frozen_runs[f"{c} frozen 0"], frozen_runs[f"{c} frozen {n_frozen}"]
            for k, r in ((0, full), (n_frozen, part)):
                rows.append([c, k, fmt_mib(r["held_bytes"]), fmt_mib(r["steady_rss"]), fmt_mib(r["peak_rss"]),
                             "-" if k == 0 else fmt_mib(full["held_bytes"] - r["held_bytes"]),
                             "-" if k == 0 else fmt_mib(full["peak_rss"] - r["peak_rss"]),
                             f"{r['losses'][-1]:.6f}"])
            ratios[f"peak_rss {c} frozen/trainable"] = part["peak_rss"] / full["peak_rss"]
            ratios[f"held_bytes {c} frozen/trainable"] = part["held_bytes"] / full["held_bytes"]
        print(_common.table(["case", "blocks frozen", "held tensors MiB", "steady RSS", "peak RSS", "held saved",
                             "peak saved", "final loss"], rows))
    if ckpt_run:
        print(f"\n== checkpoints of use_zero=3 (GPT {args.layers} x {args.embd}, Adam): RSS a rank adds, per "
              f"operation its larger rank; checks {ckpt_run['checks']} ==")
        print(_fsdp_ckpt.report(ckpt_run, _common.table, fmt_mib))
    if life:
        print(f"\n== whole life (build on meta, load from a Hugging Face directory, {args.life_steps} steps, save): "
              f"{life['params']:,}-parameter Llama, use_zero=3 on {args.life_nproc} ranks against one process; worst "
              f"rank's peak RSS above its baseline / the one process's = {life['ratio']:.3f} (target <= "
              f"{_fsdp_life.TARGET}: {'met' if life['met'] else 'NOT met'}); loss rel diff {life['loss_rel_diff']:.1e} ==")
        print(_fsdp_life.report(life, _common.table, fmt_mib))
    if train:
        print(f"\n== nnscaler train, examples/trainer/hf_llama.yaml with a {train['params']:,}-parameter Llama, "
              f"{train['nproc']} processes, {train['steps']} steps ==")
        print(_fsdp_train.report(train, _common.table, fmt_mib))
    elapsed = time.perf_counter() - t_start
    print(f"\ntotal {elapsed:.0f} s; load average before {load_before}, after {_common.loadavg()}")
    data = {**_common.run_header(),
            "config": {**vars(args), "threads_per_rank": threads,
                       "malloc_env": None if args.no_malloc_env else _rss.MALLOC_ENV},
            "targets": TARGETS, "ratios": ratios,
            "targets_met": {k: ratios[k] <= v for k, v in TARGETS.items() if k in ratios},
            "step_time": {"median_s": step, "per_block_s": r0["step_s"] if r0 else {},
                          "rounds": r0["rounds"] if r0 else [], "phases_ms_rank0": r0["phases_ms"] if r0 else {},
                          "build_s_rank0": r0["build_s"] if r0 else {},
                          "zero3_stats": r0["zero3_stats"] if r0 else {}, "losses": r0["losses"] if r0 else {},
                          "spawn_s": time_spawn_s, "per_rank": timing},
            "memory": mem, "loss_checks": checks, "loss_rtol": args.loss_rtol,
            "all_losses_ok": all(x["ok"] for x in checks.values()),
            "budget": {"budget_bytes": budget, "demo_layers": args.demo_layers, "demo_embd": args.demo_embd,
                       "runs": budget_runs},
            "accumulation": {"micros": args.accum_micros, "runs": accum_runs,
                             "note": "no_sync: the first micro-batches keep the units' full gradients, the last "
                                     "reduce-scatters the sum; each: every micro-batch reduce-scatters"},
            "checkpoint": ckpt_run,
            "frozen": {"blocks": n_frozen if frozen_runs else None, "runs": frozen_runs},
            "life": life, "train": train,
            "loadavg_before": load_before, "loadavg_after": _common.loadavg(), "seconds": elapsed}
    _common.save_results(args.out, data)


if __name__ == "__main__":
    main()
