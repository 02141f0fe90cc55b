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
import json
import math
import os
import re
import socket
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
import torch.multiprocessing as mp  # noqa: E402

TARGET_RATIO = 1.00
TOL = 1e-9


def gpt_config(args):
    from gpt import GPTConfig
    return GPTConfig(vocab_size=args.vocab, block_size=args.block_size, n_layer=args.layers,
                     n_head=args.heads, n_embd=args.embd, use_sdpa=False)


def base_model(args):
    from gpt import GPT
    torch.manual_seed(0)
    return GPT(gpt_config(args))


def batch(args, step: int = 0):
    from gpt import random_batch
    return random_batch(step, args.batch, gpt_config(args))


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


def worker(rank: int, args, t: int, result_file: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), RANK=str(rank),
                      WORLD_SIZE=str(t), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(t))
    torch.set_num_threads(max(1, _common.cpu_count() // t))
    dist.init_process_group("gloo", rank=rank, world_size=t)
    try:
        mine = _measure(rank, args, t)
        gathered = [None] * t
        dist.all_gather_object(gathered, mine)
        if rank == 0:
            Path(result_file).write_text(json.dumps(gathered))
    finally:
        from nnscaler.runtime.grid import RankGrid
        RankGrid.destroy_all()
        dist.destroy_process_group()


# -- launcher -------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fmt(b: float) -> str:
    return f"{b:,.0f}"


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


# -- ZeRO stage 1 / data parallel: parameters, gradients, optimizer state -------------------------

# name: (plan_ngpus, dp, use_zero, zero_ngroups, policy (None: --policy))
ZERO_CASES = {
    "dp2": (1, 2, False, 1, "dp"),
    "zero-dp2": (1, 2, True, 1, "dp"),
    "zero-dp3": (1, 3, True, 1, "dp"),  # 834,304 elements do not split 3 ways: padding
    "zero-dp4": (1, 4, True, 1, "dp"),
    "zero-g2-dp4": (1, 4, True, 2, "dp"),
    "zero-tp2dp2": (2, 2, True, 1, None),
}
MOMENTS = ("exp_avg", "exp_avg_sq")


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one buffer count once)."""
    seen = {}
    for t in tensors:
        if t is None:
            continue
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _measure_zero(rank: int, args, name: str) -> dict:
    from nnscaler import ComputeConfig, build_optimizer, parallelize
    plan, dp, use_zero, ngroups, policy = ZERO_CASES[name]
    policy = policy or args.policy
    cfg = ComputeConfig(plan, plan * dp, use_zero=use_zero, zero_ngroups=ngroups, trace_strategy="cpu")
    pm = parallelize(base_model(args), batch(args), policy, cfg, gen_savedir=args.gen_dir,
                     instance_name=name.replace("-", "_"), reuse="override")
    opt = build_optimizer(pm, torch.optim.Adam, lr=1e-3)
    opt.zero_grad()
    loss = pm(**batch(args))
    loss.backward()
    opt.step()
    params = list(pm.parameters())  # distinct
    trainable = [p for p in params if p.requires_grad]
    moments = other = 0
    for st in opt.state.values():
        for k, v in st.items():
            if torch.is_tensor(v):
                if k in MOMENTS:
                    moments += v.numel() * v.element_size()
                else:
                    other += v.numel() * v.element_size()
    held = [t for g in opt.param_groups for t in g["params"]]
    pids = {id(p) for p in params}
    shard_grads = [t.grad for t in held if id(t) not in pids]
    reducer = getattr(pm, "reducer", None)
    red_buf = _storage_bytes([b.buffer for b in getattr(reducer, "_buckets", [])]) if reducer is not None else 0
    out = {"rank": dist.get_rank(), "psi": sum(p.numel() for p in trainable),
           "elem": trainable[0].element_size(),
           "param_bytes": sum(p.numel() * p.element_size() for p in params),
           "grad_bytes": sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None),
           "moment_bytes": moments, "other_state_bytes": other, "state_entries": len(opt.state),
           "shard_grad_buffer_bytes": _storage_bytes(shard_grads), "reducer_buffer_bytes": red_buf,
           "reducer_attached": reducer is not None, "loss": loss.item(), "layout": None}
    lay = opt.zero_layout
    if lay is not None:
        owned = sum(pc.numel for pc in lay.pieces)
        out["layout"] = {"group_size": lay.group_size, "group_index": lay.group_index, "ngroups": lay.ngroups,
                         "group_ranks": list(lay.group_ranks), "buckets": len(lay.buckets),
                         "flat_numel": lay.flat_numel, "padded_numel": lay.padded_numel, "padding": lay.padding,
                         "shard_numel": lay.shard_numel, "owned_numel": owned,
                         "rank_padding": lay.shard_numel - owned, "pieces": len(lay.pieces)}
    dist.barrier()
    return out


def zero_worker(rank: int, args, name: str, world: int, result_file: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(max(1, _common.cpu_count() // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mine = _measure_zero(rank, args, name)
        gathered = [None] * world
        dist.all_gather_object(gathered, mine)
        if rank == 0:
            Path(result_file).write_text(json.dumps(gathered))
    finally:
        from nnscaler.runtime.grid import RankGrid
        RankGrid.destroy_all()
        dist.destroy_process_group()


def run_zero_case(args, name: str, tmp: str) -> dict:
    plan, dp, use_zero, ngroups, policy = ZERO_CASES[name]
    world = plan * dp
    z = dp // ngroups if use_zero else 1
    args.port = _free_port()
    result_file = os.path.join(tmp, f"result_{name}.json")
    t0 = time.perf_counter()
    mp.spawn(zero_worker, args=(args, name, world, result_file), nprocs=world)
    spawn_s = time.perf_counter() - t0
    ranks = json.loads(Path(result_file).read_text())
    label = (f"{'ZeRO-1' if use_zero else 'DDP (dp)'} {policy or args.policy}"
             + (f" tp{plan}" if plan > 1 else "") + f" dp{dp}" + (f" ngroups {ngroups} (z={z})" if use_zero else ""))
    print(f"\n== {name}: {label} ({world} gloo processes x {max(1, _common.cpu_count() // world)} thread(s), "
          f"{spawn_s:.1f} s) ==")
    rows, per_rank = [], []
    for r in ranks:
        e, psi = r["elem"], r["psi"]
        a_p, a_g, a_m = e * psi, e * psi, 2 * e * psi / z
        lay = r["layout"]
        owned = lay["owned_numel"] if lay else psi
        m_pad = 2 * e * owned  # moments of the elements this rank really owns
        total = r["param_bytes"] + r["grad_bytes"] + r["moment_bytes"]
        a_total = a_p + a_g + a_m
        x = {"rank": r["rank"], "psi": psi, "analytic": {"params": a_p, "grads": a_g, "moments": a_m,
                                                         "total": a_total, "moments_owned": m_pad},
             "ratio_params": r["param_bytes"] / a_p, "ratio_grads": r["grad_bytes"] / a_g,
             "ratio_moments": r["moment_bytes"] / a_m, "ratio_moments_padding_accounted": r["moment_bytes"] / m_pad,
             "ratio_total": total / a_total,
             "ratio_total_padding_accounted": total / (a_p + a_g + m_pad),
             "ratio_total_with_all_state": (total + r["other_state_bytes"]) / a_total,
             **{k: r[k] for k in ("param_bytes", "grad_bytes", "moment_bytes", "other_state_bytes", "state_entries",
                                  "shard_grad_buffer_bytes", "reducer_buffer_bytes", "reducer_attached", "loss",
                                  "layout")}}
        per_rank.append(x)
        rows.append([f"rank {r['rank']}", f"{psi:,}", _fmt(r["param_bytes"]), _fmt(r["grad_bytes"]),
                     _fmt(r["moment_bytes"]), _fmt(a_m), f"{x['ratio_moments']:.4f}",
                     str(lay["rank_padding"]) if lay else "-", f"{x['ratio_moments_padding_accounted']:.4f}",
                     _fmt(total), _fmt(a_total), f"{x['ratio_total']:.4f}", _fmt(r["other_state_bytes"]),
                     _fmt(r["shard_grad_buffer_bytes"]), _fmt(r["reducer_buffer_bytes"])])
    print(_common.table(["rank", "Psi", "params B", "grads B", "moments B", "8Psi/z", "ratio m", "pad elems",
                         "ratio m (pad)", "p+g+m B", "analytic", "ratio", "step B", "shard-grad buf B",
                         "reducer buf B"], rows))
    # every element's moments exist once per zero group
    checks = []
    if use_zero:
        groups = defaultdict(list)
        for r in ranks:
            groups[tuple(r["layout"]["group_ranks"])].append(r)
        for g, rs in groups.items():
            owned = sum(r["layout"]["owned_numel"] for r in rs)
            checks.append({"group": list(g), "owned_sum": owned, "psi": rs[0]["psi"],
                           "moments_sum": sum(r["moment_bytes"] for r in rs),
                           "covers_once": owned == rs[0]["psi"] and rs[0]["layout"]["flat_numel"] == rs[0]["psi"]})
        lay0 = ranks[0]["layout"]
        print(f"layout: {lay0['buckets']} bucket(s), {lay0['flat_numel']:,} elements padded to "
              f"{lay0['padded_numel']:,} (padding {lay0['padding']} elements = {lay0['padding'] * ranks[0]['elem']} B "
              f"per zero group), shard {lay0['shard_numel']:,} elements per rank; per zero group the owned pieces "
              f"cover every element once: {all(c['covers_once'] for c in checks)} "
              f"(moments summed over a group = 8 Psi: "
              f"{all(c['moments_sum'] == 2 * ranks[0]['elem'] * c['psi'] for c in checks)})")
    worst = max(per_rank, key=lambda x: abs(x["ratio_total"] - 1))
    return {"case": name, "label": label, "plan_ngpus": plan, "dp": dp, "world": world, "use_zero": use_zero,
            "zero_ngroups": ngroups, "z": z, "policy": policy or args.policy, "per_rank": per_rank,
            "group_checks": checks, "worst_ratio_total": worst["ratio_total"],
            "worst_ratio_moments": max((x["ratio_moments"] for x in per_rank), key=lambda v: abs(v - 1)),
            "worst_ratio_moments_padding_accounted": max((x["ratio_moments_padding_accounted"] for x in per_rank),
                                                         key=lambda v: abs(v - 1)),
            "spawn_seconds": spawn_s}


def zero_summary(zc: list) -> None:
    print()
    rows = []
    for c in zc:
        r0 = c["per_rank"][0]
        pad = max((x["layout"]["rank_padding"] for x in c["per_rank"] if x["layout"]), default=0)
        rows.append([c["case"], c["z"], f"{r0['psi']:,}", _fmt(max(x["param_bytes"] + x["grad_bytes"] + x["moment_bytes"]
                                                                  for x in c["per_rank"])),
                     _fmt(r0["analytic"]["total"]), f"{c['worst_ratio_total']:.4f}",
                     f"{c['worst_ratio_moments']:.4f}", pad, f"{c['worst_ratio_moments_padding_accounted']:.4f}",
                     _fmt(max(x["shard_grad_buffer_bytes"] for x in c["per_rank"])),
                     _fmt(max(x["reducer_buffer_bytes"] for x in c["per_rank"]))])
    print(_common.table(["case", "z", "Psi/rank", "p+g+m B (max)", "analytic", "ratio (worst)", "moments ratio",
                         "max pad elems", "moments (pad)", "shard-grad buf", "reducer buf"], rows))
    print("analytic: DDP 16 Psi, ZeRO-1 4 Psi + 4 Psi + 8 Psi/z (Adam fp32); p+g+m = params + grads + Adam "
          "moments; step scalars and the buffers are reported apart")


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


def act_worker(rank: int, args, result_file: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    torch.set_num_threads(_common.cpu_count())
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        res = {k: _measure_act(args, k == "recompute") for k in ("plain", "recompute")}
        Path(result_file).write_text(json.dumps(res))
    finally:
        from nnscaler.runtime.grid import RankGrid
        RankGrid.destroy_all()
        dist.destroy_process_group()


def run_activation(args, tmp: str) -> dict:
    args.port = _free_port()
    result_file = os.path.join(tmp, "result_act.json")
    t0 = time.perf_counter()
    mp.spawn(act_worker, args=(args, result_file), nprocs=1)
    spawn_s = time.perf_counter() - t0
    res = json.loads(Path(result_file).read_text())
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
    args = p.parse_args()
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
            args.port = _free_port()
            result_file = os.path.join(tmp, f"result_tp{t}.json")
            t0 = time.perf_counter()
            mp.spawn(worker, args=(args, t, result_file), nprocs=t)
            spawn_s = time.perf_counter() - t0
            cases.append(report(args, t, a, json.loads(Path(result_file).read_text()), spawn_s))
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
        "timestamp": _common.timestamp(),
        "command": _common.command_line(),
        "machine": _common.machine_info(),
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
    path = Path(args.out)
    if path.resolve().parent == _common.RESULTS_DIR.resolve():
        path = _common.write_json(path.name, data)
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
