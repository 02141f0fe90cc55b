"""Per-rank parameter and gradient bytes of a tensor-parallel plan against the analytic value.

    python bench/memory.py [--tp 2 4] [--policy megatron] [--layers 4] [--embd 128]

For every tensor-parallel degree t (plan_ngpus = runtime_ngpus = t, no data parallelism), t gloo
processes (torch.multiprocessing.spawn) each parallelize the example GPT (examples/gpt.py, seed 0)
with the Megatron-style plan (`--policy`, default `megatron`), run one training step (forward +
backward, so every gradient exists) and measure the bytes of their parameters and gradients
(`numel * element_size` of every distinct parameter of the rank's module and of its `.grad`;
tied tensors count once, as they are stored once). Each rank gets max(1, cores // t) intra-op
threads.

Analytic reference, from the single-device model and the plan's storage decisions
(`nnscaler.codegen.layouts.plan_unit(graph, t).stored`, the plan parallelize() generates from):
every full parameter is either sharded (stored `D(dim)`: each rank holds 1/t of it) or
replicated (stored `R`: each rank holds all of it), so

    analytic bytes per rank = sharded bytes / t + replicated bytes

(gradients: the same sum over trainable parameters). Printed per rank: measured, analytic,
ratio measured/analytic (target 1.00), the list of replicated tensors (names, bytes) and the
comparison with the unpartitioned model (full bytes, and the ideal full / t). The generated
modules' `fullmap` (`replicas` = t for a replicated tensor, 1 for a shard) is cross-checked
against the plan's decisions.

ZeRO stage 1 (`--zero-cases`, default dp2 zero-dp2 zero-dp3 zero-dp4 zero-g2-dp4 zero-tp2dp2;
zero-dp3 because the model's 834,304 elements do not split 3 ways, so its layout is padded): each case
spawns its plan_ngpus x dp gloo processes, parallelizes with `ComputeConfig(plan, world,
use_zero=..., zero_ngroups=g)` (policy `dp`, or `--policy` for tp 2 x dp 2), builds
`build_optimizer(pm, torch.optim.Adam, lr=1e-3)` and runs one forward + backward + step. Per rank:
bytes of the parameters, of their `.grad`, of the optimizer state (every tensor in `opt.state`,
split into Adam's moments `exp_avg`/`exp_avg_sq` and the per-tensor `step` scalars), of the ZeRO
shard-gradient buffer and of the Reducer's flat buffer (reported apart), against Adam fp32 with
Psi = this rank's trainable parameters before ZeRO (tp-local for tp x dp): DDP 16 Psi (4 Psi
params + 4 Psi grads + 8 Psi moments); ZeRO-1 4 Psi + 4 Psi + 8 Psi / z, z = dp / zero_ngroups.
The padding of `opt.zero_layout` (buckets padded to a multiple of z) is reported apart, with the
ratio of the moments to 8 x (elements this rank really owns).

Activation memory (`--act`, on by default): one process, world 1, policy `dp`, with and without
`pas_config={'recompute_modules': 'Block'}`; after one warm-up step (gradients kept allocated),
one forward + backward: bytes saved for backward (`torch.autograd.graph.saved_tensors_hooks`,
sum of numel * element_size at pack time, and the same over distinct storages) and the CPU
allocator's live bytes from `torch.profiler` (profile_memory): held at the end of forward and
peak over forward + backward, both relative to the start of the step.

Writes bench/results/memory.json.
"""
from __future__ import annotations

import argparse
import math
import os
import re
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

_common.add_examples_to_path()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _zero_memory import ZERO_CASES, run_zero_case, zero_summary  # noqa: E402

TARGET_RATIO = 1.00
TOL = 1e-9


base_model = _common.base_model
batch = _common.batch
_fmt = _common.fmt_bytes


def compute_config(args, t: int):
    from nnscaler import ComputeConfig
    return ComputeConfig(t, t, trace_strategy="cpu")


# -- analytic -------------------------------------------------------------------------------------

def analytic(args, t: int) -> dict:
    """Sharded / replicated full parameters of the plan, from the single-device model."""
    from nnscaler.codegen.layouts import plan_unit
    from nnscaler.ir import trace
    from nnscaler.ir.layout import Shard
    from nnscaler.policies import apply_policy
    model = base_model(args)
    graph = apply_policy(trace(model, batch(args), trace_strategy="cpu"), compute_config(args, t), args.policy)
    unit = plan_unit(graph, t)
    tensors = dict(model.named_parameters())  # distinct tensors (the tied lm_head.weight is wte.weight)
    params = []
    for name, spec in graph.params.items():
        p = tensors[name]
        full = p.numel() * p.element_size()
        assert tuple(p.shape) == tuple(spec.shape), name
        stored = unit.stored[name]
        params.append({"name": name, "aliases": list(spec.aliases), "shape": list(p.shape), "dtype": spec.dtype,
                       "full_bytes": full, "stored": repr(stored), "sharded": isinstance(stored, Shard),
                       "trainable": spec.requires_grad})
    buffers = [{"name": n, "shape": list(s.shape), "dtype": s.dtype, "stored": repr(unit.stored[n]),
                "full_bytes": math.prod(s.shape) * getattr(torch, s.dtype).itemsize}
               for n, s in list(graph.buffers.items()) + list(graph.constants.items())]
    sharded = sum(p["full_bytes"] for p in params if p["sharded"])
    replicated = sum(p["full_bytes"] for p in params if not p["sharded"])
    g_sharded = sum(p["full_bytes"] for p in params if p["sharded"] and p["trainable"])
    g_replicated = sum(p["full_bytes"] for p in params if not p["sharded"] and p["trainable"])
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"params": params, "buffers": buffers, "sharded_bytes": sharded, "replicated_bytes": replicated,
            "param_bytes_per_rank": sharded / t + replicated,
            "grad_bytes_per_rank": g_sharded / t + g_replicated,
            "model_param_bytes": model_bytes, "model_params": sum(p.numel() for p in model.parameters())}


# -- per process ----------------------------------------------------------------------------------

def _measure(rank: int, args, t: int) -> dict:
    from nnscaler import parallelize
    pm = parallelize(base_model(args), batch(args), args.policy, compute_config(args, t),
                     gen_savedir=args.gen_dir, instance_name=f"{args.policy}_tp{t}", reuse="override")
    loss = pm(**batch(args))
    loss.backward()
    fullmap = pm.fullmap
    params = []
    for name, p in pm.named_parameters():  # distinct parameters
        e = fullmap[name]
        params.append({"local": name, "full_name": e.full_name, "replicas": e.replicas,
                       "local_shape": list(p.shape), "bytes": p.numel() * p.element_size(),
                       "grad_bytes": p.grad.numel() * p.grad.element_size() if p.grad is not None else None})
    buffers = [{"local": n, "bytes": b.numel() * b.element_size()} for n, b in pm.named_buffers()]
    dist.barrier()
    return {"params": params, "buffers": buffers, "loss": loss.item(),
            "aliases": dict(pm.full_aliases)}


# -- launcher -------------------------------------------------------------------------------------

def _kind(name: str) -> str:
    """Group replicated tensors: 'h.3.ln_1.weight' -> 'h.*.ln_1.weight'."""
    parts = name.split(".")
    if len(parts) > 2 and parts[0] == "h" and parts[1].isdigit():
        parts[1] = "*"
    return ".".join(parts)


def report(args, t: int, a: dict, ranks: list, spawn_s: float) -> dict:
    full = a["model_param_bytes"]
    print(f"\n== {args.policy} tp{t} ({t} gloo processes x {max(1, _common.cpu_count() // t)} thread(s), "
          f"{spawn_s:.1f} s) ==")
    # cross-check the generated storage against the plan's decisions
    plan = {p["name"]: p for p in a["params"]}
    mismatches = []
    for i, r in enumerate(ranks):
        seen = set()
        for e in r["params"]:
            p = plan.get(e["full_name"])
            if p is None:
                mismatches.append(f"rank {i}: {e['full_name']} not a parameter of the plan")
                continue
            seen.add(e["full_name"])
            want = 1 if p["sharded"] else t
            if e["replicas"] != want:
                mismatches.append(f"rank {i}: {e['full_name']} replicas {e['replicas']}, plan stores {p['stored']}")
            want_bytes = p["full_bytes"] / t if p["sharded"] else p["full_bytes"]
            if e["bytes"] != want_bytes:
                mismatches.append(f"rank {i}: {e['full_name']} holds {e['bytes']} B, plan {want_bytes:.0f} B")
        missing = set(plan) - seen
        if missing:
            mismatches.append(f"rank {i}: missing {sorted(missing)}")

    rows, per_rank = [], []
    for i, r in enumerate(ranks):
        pb = sum(e["bytes"] for e in r["params"])
        gb = sum(e["grad_bytes"] or 0 for e in r["params"])
        no_grad = [e["full_name"] for e in r["params"] if e["grad_bytes"] is None]
        bb = sum(e["bytes"] for e in r["buffers"])
        rep = sum(e["bytes"] for e in r["params"] if e["replicas"] > 1)
        shard = sum(e["bytes"] for e in r["params"] if e["replicas"] == 1)
        pr = pb / a["param_bytes_per_rank"]
        gr = gb / a["grad_bytes_per_rank"]
        per_rank.append({"rank": i, "param_bytes": pb, "grad_bytes": gb, "buffer_bytes": bb,
                         "replicated_param_bytes": rep, "sharded_param_bytes": shard,
                         "params_without_grad": no_grad, "param_ratio": pr, "grad_ratio": gr,
                         "fraction_of_model": pb / full, "vs_ideal_full_over_t": pb / (full / t),
                         "loss": r["loss"]})
        ok = abs(pr - 1) <= TOL and abs(gr - 1) <= TOL
        rows.append([f"rank {i}", _fmt(pb), _fmt(gb), _fmt(a["param_bytes_per_rank"]), _fmt(a["grad_bytes_per_rank"]),
                     f"{pr:.3f}", f"{gr:.3f}", f"{pb / full:.3f}", f"{pb / (full / t):.3f}", _fmt(bb),
                     "ok" if ok else "OFF"])
    print(_common.table(["rank", "params B", "grads B", "analytic params", "analytic grads", "ratio p",
                         "ratio g", "of full model", "vs full/t", "buffers B", "= 1.00"], rows))
    print(f"unpartitioned model: {a['model_params']:,} parameters, {_fmt(full)} B (params; grads the same); "
          f"ideal per rank full/{t} = {_fmt(full / t)} B")
    print(f"plan: sharded {_fmt(a['sharded_bytes'])} B ({a['sharded_bytes'] / full:.1%} of the model) -> "
          f"{_fmt(a['sharded_bytes'] / t)} B per rank; replicated {_fmt(a['replicated_bytes'])} B "
          f"({a['replicated_bytes'] / full:.1%}) on every rank; excess over full/{t}: "
          f"{_fmt(a['replicated_bytes'] * (1 - 1 / t))} B per rank")
    groups = defaultdict(lambda: [0, 0, ""])
    for p in a["params"]:
        if not p["sharded"]:
            g = groups[_kind(p["name"])]
            g[0] += 1
            g[1] += p["full_bytes"]
            g[2] = "x".join(map(str, p["shape"])) + (f", tied to {', '.join(p['aliases'])}" if p["aliases"] else "")
    print("replicated parameters (full bytes on every rank):")
    print(_common.table(["name", "tensors", "bytes", "share of replicated", "shape"],
                        [[k, v[0], _fmt(v[1]), f"{v[1] / a['replicated_bytes']:.1%}", v[2]]
                         for k, v in sorted(groups.items(), key=lambda kv: -kv[1][1])]))
    sharded_kinds = sorted({_kind(p["name"]) + f" {p['stored']}" for p in a["params"] if p["sharded"]})
    print("sharded: " + ", ".join(sharded_kinds))
    if a["buffers"]:
        print("buffers (not counted above): " + ", ".join(
            f"{_kind(b['name'])} {b['dtype']} {_fmt(b['full_bytes'])} B {b['stored']}" for b in a["buffers"][:1])
            + (f" (x{len(a['buffers'])})" if len(a["buffers"]) > 1 else ""))
    print("generated fullmap agrees with the plan's storage: " + ("yes" if not mismatches else
                                                                  "NO: " + "; ".join(mismatches[:10])))
    return {
        "tp": t, "policy": args.policy,
        "analytic": {k: a[k] for k in ("sharded_bytes", "replicated_bytes", "param_bytes_per_rank",
                                       "grad_bytes_per_rank", "model_param_bytes", "model_params")},
        "per_rank": per_rank,
        "ratio_params": [x["param_ratio"] for x in per_rank],
        "ratio_grads": [x["grad_ratio"] for x in per_rank],
        "replicated": [{"name": p["name"], "shape": p["shape"], "bytes": p["full_bytes"]}
                       for p in a["params"] if not p["sharded"]],
        "replicated_groups": {k: {"tensors": v[0], "bytes": v[1]} for k, v in groups.items()},
        "sharded": [{"name": p["name"], "shape": p["shape"], "stored": p["stored"], "full_bytes": p["full_bytes"]}
                    for p in a["params"] if p["sharded"]],
        "buffers": a["buffers"],
        "fullmap_mismatches": mismatches,
        "spawn_seconds": spawn_s,
    }


# -- activation memory with and without recompute -------------------------------------------------

def _live_bytes_profile(fn_fwd, fn_bwd):
    """(held at the end of forward, peak over forward + backward): CPU allocator bytes relative to the
    start, from torch.profiler's memory events."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile, record_function
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with record_function("bench_fwd"):
            out = fn_fwd()
        with record_function("bench_bwd"):
            fn_bwd(out)
    allocs, fwd_end = [], None

    def walk(n):
        nonlocal fwd_end
        if n.tag == _EventType.Allocation:
            allocs.append((n.start_time_ns, n.extra_fields.alloc_size))
        elif n.name == "bench_fwd":
            fwd_end = n.end_time_ns
        for c in n.children:
            walk(c)
    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    allocs.sort()
    cur = peak = held = 0
    for ts, size in allocs:
        cur += size
        peak = max(peak, cur)
        if fwd_end is not None and ts <= fwd_end:
            held = cur
    return held, peak, len(allocs)


def _measure_act(args, recompute: bool) -> dict:
    from nnscaler import ComputeConfig, parallelize
    pas = {"recompute_modules": "Block"} if recompute else {}
    cfg = ComputeConfig(1, 1, trace_strategy="cpu", pas_config=pas)
    name = "act_recompute" if recompute else "act_plain"
    pm = parallelize(base_model(args), batch(args), "dp", cfg, gen_savedir=args.gen_dir, instance_name=name,
                     reuse="override")
    b = batch(args)
    pm(**b).backward()  # warm-up: gradients allocated once, kept (zeroed in place) below
    for p in pm.parameters():
        if p.grad is not None:
            p.grad.zero_()
    saved = {"sum": 0, "count": 0, "storages": {}}

    def pack(t):
        saved["sum"] += t.numel() * t.element_size()
        saved["count"] += 1
        s = t.untyped_storage()
        saved["storages"][s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = pm(**b)
    loss.backward()
    for p in pm.parameters():
        p.grad.zero_()

    held, peak, n_alloc = _live_bytes_profile(lambda: pm(**b), lambda l: l.backward())
    gen = list(Path(args.gen_dir).glob(f"**/{name}/gencode0.py"))
    ckpt_calls = len(re.findall(r"checkpoint\(", gen[0].read_text())) if gen else None
    return {"recompute_modules": pas.get("recompute_modules"), "saved_bytes_sum": saved["sum"],
            "saved_tensors": saved["count"], "saved_bytes_distinct_storages": sum(saved["storages"].values()),
            "live_after_forward_bytes": held, "peak_fwd_bwd_bytes": peak, "allocations": n_alloc,
            "checkpoint_calls_in_gencode": ckpt_calls, "loss": loss.item()}


def _measure_act_both(rank: int, args) -> dict:
    return {k: _measure_act(args, k == "recompute") for k in ("plain", "recompute")}


def run_activation(args, tmp: str) -> dict:
    res, spawn_s = _common.spawn_gloo(_measure_act_both, (args,), 1, os.path.join(tmp, "result_act.json"),
                                      gather=False)
    pl, rc = res["plain"], res["recompute"]
    btc = args.batch * args.block_size * args.embd * 4
    print(f"\n== activation memory, one forward + backward, single process, B={args.batch} T={args.block_size} "
          f"C={args.embd} ({spawn_s:.1f} s) ==")
    keys = [("saved for backward (hooks, sum)", "saved_bytes_sum"),
            ("saved for backward (distinct storages)", "saved_bytes_distinct_storages"),
            ("live bytes at end of forward (profiler)", "live_after_forward_bytes"),
            ("peak live bytes over fwd+bwd (profiler)", "peak_fwd_bwd_bytes")]
    rows = [[label, _fmt(pl[k]), _fmt(rc[k]), f"{rc[k] / pl[k]:.3f}" if pl[k] else "-",
             f"{pl[k] / rc[k]:.2f}x" if rc[k] else "-"] for label, k in keys]
    print(_common.table(["measure", "no recompute B", "recompute Block B", "ratio rc/plain", "saving"], rows))
    print(f"saved tensors: {pl['saved_tensors']} / {rc['saved_tensors']}; checkpoint calls in gencode0.py: "
          f"{pl['checkpoint_calls_in_gencode']} / {rc['checkpoint_calls_in_gencode']}; losses "
          f"{pl['loss']:.6f} / {rc['loss']:.6f}; B*T*C*4 = {_fmt(btc)} B (one block input); the hooks do not see "
          f"what checkpoint keeps (each block's inputs), the profiler does; gradients were allocated before "
          f"the measured step, so the peak excludes them")
    return {"plain": pl, "recompute": rc, "btc_bytes": btc, "spawn_seconds": spawn_s,
            "ratio": {k: (rc[k] / pl[k] if pl[k] else None) for _, k in keys}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, nargs="*", default=[2, 4], help="tensor-parallel degrees (default 2 4; none: skip)")
    p.add_argument("--policy", default="megatron", help="plan (default megatron)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--embd", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--zero-cases", nargs="*", default=list(ZERO_CASES),
                   help=f"ZeRO/dp cases (default all: {' '.join(ZERO_CASES)}; none: empty)")
    p.add_argument("--no-act", dest="act", action="store_false", help="skip the activation (recompute) part")
    p.add_argument("--out", default=str(_common.RESULTS_DIR / "memory.json"))
    args = _common.parse_args(p, {"tp": [2], "zero_cases": ["zero-dp2"], "layers": 1, "embd": 16, "heads": 2,
                                  "block_size": 8, "vocab": 32, "batch": 2}, "memory.json")
    bad = [c for c in args.zero_cases if c not in ZERO_CASES]
    if bad:
        p.error(f"unknown --zero-cases {bad}; known: {list(ZERO_CASES)}")
    if any(t < 2 for t in args.tp):
        p.error("--tp degrees must be >= 2")
    cores = _common.cpu_count()
    t_start = time.perf_counter()
    print(f"memory: GPT n_layer={args.layers} n_embd={args.embd} n_head={args.heads} T={args.block_size} "
          f"vocab={args.vocab}; policy {args.policy}; tp {args.tp}; {cores} cores", flush=True)
    cases = []
    with tempfile.TemporaryDirectory(prefix="nnscaler_bench_mem_") as tmp:
        args.gen_dir = os.path.join(tmp, "gen")
        for t in args.tp:
            a = analytic(args, t)
            ranks, spawn_s = _common.spawn_gloo(_measure, (args, t), t, os.path.join(tmp, f"result_tp{t}.json"))
            cases.append(report(args, t, a, ranks, spawn_s))
        zero_cases = []
        for name in args.zero_cases:
            zero_cases.append(run_zero_case(args, name, tmp))
        if zero_cases:
            zero_summary(zero_cases)
        act = run_activation(args, tmp) if args.act else None
    wall = time.perf_counter() - t_start

    if cases:
        print()
    full = cases[0]["analytic"]["model_param_bytes"] if cases else 0
    rows = []
    for c in cases:
        worst_p = max(c["ratio_params"], key=lambda r: abs(r - 1))
        worst_g = max(c["ratio_grads"], key=lambda r: abs(r - 1))
        pb = max(x["param_bytes"] for x in c["per_rank"])
        rows.append([f"{c['policy']} tp{c['tp']}", _fmt(pb), _fmt(c["analytic"]["param_bytes_per_rank"]),
                     f"{worst_p:.3f}", f"{worst_g:.3f}", f"{pb / full:.3f}", f"{1 / c['tp']:.3f}",
                     f"{pb / (full / c['tp']):.2f}", _fmt(c["analytic"]["replicated_bytes"]),
                     "ok" if abs(worst_p - 1) <= TOL and abs(worst_g - 1) <= TOL and not c["fullmap_mismatches"]
                     else "OFF"])
    if rows:
        print(_common.table(["plan", "params B/rank", "analytic", "ratio p", "ratio g", "of full", "ideal 1/t",
                             "x ideal", "replicated B", "= 1.00"], rows))
        print(f"full model {_fmt(full)} B of parameters (same for gradients); worst rank shown")
    print(f"total wall time {wall:.1f} s")
    data = {
        **_common.run_header(),
        "config": {"tp": args.tp, "policy": args.policy, "backend": "gloo", "zero_cases": args.zero_cases,
                   "zero_case_specs": {k: dict(zip(("plan_ngpus", "dp", "use_zero", "zero_ngroups", "policy"), v))
                                       for k, v in ZERO_CASES.items() if k in args.zero_cases},
                   "activation": bool(args.act),
                   "threads_per_rank": {str(t): max(1, cores // t) for t in args.tp},
                   "model": {"n_layer": args.layers, "n_embd": args.embd, "n_head": args.heads,
                             "block_size": args.block_size, "vocab_size": args.vocab, "use_sdpa": False},
                   "batch": args.batch, "step": "one forward + backward"},
        "target_ratio": TARGET_RATIO,
        "cases": cases,
        "zero": {"formula": "Adam fp32, Psi = trainable params per rank before ZeRO (tp-local): "
                            "DDP 16 Psi = 4 Psi params + 4 Psi grads + 8 Psi moments; ZeRO-1 4 Psi + 4 Psi + 8 Psi / z, "
                            "z = dp / zero_ngroups",
                 "cases": zero_cases},
        "activation": act,
        "wall_seconds": wall,
    }
    _common.save_results(args.out, data)


if __name__ == "__main__":
    main()
