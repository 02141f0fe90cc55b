"""Collectives per training step of tensor-parallel plans against the plan's analytic minimum.

    python bench/comm.py [--tp 2 4] [--policies megatron tp] [--seed 1] [--layers 4] [--steps 1]

For every policy (default: the Megatron-style plan `megatron` and `tp` with `pas_config['seed']`)
and tensor-parallel degree t (plan_ngpus = runtime_ngpus = t, so no data parallelism), t gloo
processes (torch.multiprocessing.spawn) each parallelize the example GPT (examples/gpt.py, seed 0),
run `--warmup` forward+backward steps, then count, with `nnscaler.runtime.comm.count_collectives`,
the collectives of `--steps` more steps (forward and backward counted apart). Each rank gets
max(1, cores // t) intra-op threads.

Analytic reference, from the same plan (`trace` + `apply_policy` + `codegen.layouts.plan_unit` in
the launcher): every conversion codegen emits, i.e. every distinct (value, destination layout,
grad_partial) need whose `transition_steps` is not empty (codegen caches them), plus the
conversion of the forward's outputs to R, costed with `steps_cost(..., model='payload')` (the
convention of the runtime's stats, so a plan that runs what it plans gives ratio 1.000). The
backward half of a conversion is counted only when the value requires grad (derived from the
graph: a floating-point output of an op with an input that requires grad; the trace itself does
not record it): autograd never runs the backward of a conversion of an integer or bool tensor.
The naive sum (backward always counted) is reported beside it. Ratio measured/analytic: target
<= 1.05. Collectives that ran through a fallback (stats keys ending in '(fallback)') are
reported apart (and folded into their collective's row); wire bytes (ring / pairwise
algorithms) are derived from the recorded payloads, a fallback as the collective it really ran,
beside `steps_cost(..., model='ring')` of the plan: the payload convention does not show what a
fallback costs, the wire bytes do. `--force-fallback all` exercises that path. For `megatron` the closed form (per block one all-reduce of B*T*C*4 bytes after
attention and one after the MLP in forward, the same two in backward, plus whatever converts
outside the blocks, listed) is checked against the plan-derived counts.

Also checked: the generated rank files' `nr.comm.<fn>(` calls against the plan's conversions,
and the first step's loss against the single-device model's.

ZeRO stage 1 (`--zero-dp`, default 2 4): n gloo processes, policy `dp`, variants `dp` (no ZeRO),
`zero-ar` (use_zero, Reducer all-reduce), `zero-rs` (zero_use_reduce_scatter=True) and, for n >= 4,
`zero-rs-g2` (zero_ngroups=2); one counted step = zero_grad + forward + backward + opt.step()
(keys dp_all_reduce, zero_reduce_scatter, zero_all_reduce, zero_all_gather). Against G = P = the
rank's gradient (parameter) bytes: payload (stats convention) ideal / exact (with the layout's
padding and the "has a gradient" flags) and ring wire bytes against the optimum: DDP 2(n-1)/n G,
ZeRO all-reduce 2(n-1)/n G + (n-1)/n P, ZeRO reduce-scatter (n-1)/n G + (n-1)/n P.

Writes bench/results/comm.json.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import re
import socket
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

_common.add_examples_to_path()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

TARGET_RATIO = 1.05
FALLBACK = "(fallback)"


# -- model and plan -------------------------------------------------------------------------------

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


def compute_config(policy: str, t: int, seed: int):
    from nnscaler import ComputeConfig
    pas = {"seed": seed} if policy == "tp" else {}
    return ComputeConfig(t, t, trace_strategy="cpu", pas_config=pas)


def planned_graph(args, policy: str, t: int):
    """(graph, UnitPlan) exactly as parallelize() plans it."""
    from nnscaler.codegen.layouts import plan_unit
    from nnscaler.ir import trace
    from nnscaler.policies import apply_policy
    graph = trace(base_model(args), batch(args), trace_strategy="cpu")
    graph = apply_policy(graph, compute_config(policy, t, args.seed), policy)
    return graph, plan_unit(graph, t)


def itemsize(dtype: str) -> int:
    return getattr(torch, dtype).itemsize


def nbytes(value) -> int:
    return math.prod(value.shape) * itemsize(value.dtype)


def requires_grad_values(graph) -> set:
    """Value ids that require grad at run time: trainable parameters, and floating-point outputs
    of ops that read one of them (the traced Value.requires_grad is not propagated)."""
    from nnscaler.codegen.layouts import is_shape_query
    out = {spec.value.id for spec in graph.params.values() if spec.requires_grad}
    for node in graph.nodes:
        if is_shape_query(node) or "detach" in node.target:
            continue
        if any(r.id in out for r in node.input_refs()):
            for r in node.output_refs():
                v = graph.value(r)
                if v.is_tensor and getattr(torch, v.dtype).is_floating_point:
                    out.add(r.id)
    return out


def _value_label(graph, vid: int) -> str:
    for spec in graph.tensor_specs():
        if spec.value.id == vid:
            return spec.name
    return f"{graph.values[vid].name}_{vid}"


def plan_conversions(graph, unit) -> list:
    """Every conversion codegen emits (emit._Adapter), in program order, with its payload cost."""
    from nnscaler.codegen.adapters import step_collectives, steps_cost, transition_steps
    from nnscaler.ir.graph import iter_refs
    from nnscaler.ir.layout import Replicate
    n = unit.plan_ngpus
    rg = requires_grad_values(graph)
    seen, convs = set(), []

    def add(vid, dst, grad_partial, node):
        src = unit.produced[vid]
        steps = transition_steps(src, dst, grad_partial=grad_partial)  # as emit.py calls it
        if not steps:
            return
        key = (vid, repr(dst), grad_partial)
        if key in seen:
            return
        seen.add(key)
        value = graph.values[vid]
        full = nbytes(value)
        ndim = len(value.shape)
        identity = not transition_steps(src, dst, grad_partial=grad_partial, ndim=ndim)
        fwd_c, bwd_c = step_collectives(steps)
        pay = steps_cost(steps, full, n, model="payload")
        ring = steps_cost(steps, full, n, model="ring")
        grad = vid in rg
        convs.append({
            "value": _value_label(graph, vid), "value_id": vid, "shape": list(value.shape),
            "dtype": value.dtype, "full_bytes": full, "requires_grad": grad,
            "consumer": node.target if node is not None else "<output>",
            "module": (node.module_path if node is not None else "") or "",
            "src": repr(src), "dst": repr(dst) + ("*" if grad_partial else ""),
            "steps": [s for s, _ in steps], "identity_at_runtime": identity,
            "fwd_collectives": [] if identity else fwd_c,
            "bwd_collectives": [] if identity or not grad else bwd_c,
            "naive_bwd_collectives": bwd_c,
            "fwd_bytes": 0.0 if identity else pay.forward,
            "bwd_bytes": 0.0 if identity or not grad else pay.backward,
            "naive_bwd_bytes": pay.backward,
            "ring_bytes": 0.0 if identity else ring.forward + (ring.backward if grad else 0.0),
        })

    for node in graph.nodes:
        for need in unit.needs[node.id]:
            add(need.ref_id, need.placement, need.grad_partial, node)
    for vid in sorted(set(r.id for r in iter_refs(graph.output))):
        if graph.values[vid].is_tensor:
            add(vid, Replicate(), False, None)
    return convs


def per_collective(convs, naive=False) -> dict:
    """{'fwd'|'bwd': {collective: {'calls', 'bytes'}}} of a conversion list (payload bytes)."""
    from nnscaler.codegen.adapters import COST_MODELS
    out = {"fwd": defaultdict(lambda: {"calls": 0, "bytes": 0.0}), "bwd": defaultdict(lambda: {"calls": 0, "bytes": 0.0})}
    n = None
    for c in convs:
        n = c["_n"]
        bwd = c["naive_bwd_collectives"] if naive else c["bwd_collectives"]
        for phase, names in (("fwd", c["fwd_collectives"]), ("bwd", bwd)):
            for name in names:
                out[phase][name]["calls"] += 1
                out[phase][name]["bytes"] += COST_MODELS["payload"](name, c["full_bytes"], n)
    return {k: dict(v) for k, v in out.items()}


def totals(pc: dict) -> dict:
    calls = sum(e["calls"] for ph in pc.values() for e in ph.values())
    b = sum(e["bytes"] for ph in pc.values() for e in ph.values())
    return {"calls": calls, "bytes": b}


def megatron_closed_form(args, convs, n_layer: int) -> dict:
    """Per block 2 forward + 2 backward all-reduces of B*T*C*4 bytes, plus what converts outside."""
    btc = args.batch * args.block_size * args.embd * 4
    inside = [c for c in convs if c["module"].startswith("h.")]
    outside = [c for c in convs if not c["module"].startswith("h.")]
    expected = {"fwd": {"all_reduce": {"calls": 2 * n_layer, "bytes": 2 * n_layer * btc}},
                "bwd": {"all_reduce": {"calls": 2 * n_layer, "bytes": 2 * n_layer * btc}}}
    plan_inside = per_collective(inside)
    costly_inside = [c for c in inside if c["fwd_collectives"] or c["bwd_collectives"]]
    per_block = defaultdict(lambda: {"fwd": 0, "bwd": 0})  # block -> all-reduces per pass
    for c in costly_inside:
        blk = c["module"].split(".")[1]
        per_block[blk]["fwd"] += c["fwd_collectives"].count("all_reduce")
        per_block[blk]["bwd"] += c["bwd_collectives"].count("all_reduce")
    sizes_ok = all(c["full_bytes"] == btc for c in costly_inside)
    match = (_strip(plan_inside) == _strip(expected) and sizes_ok and len(per_block) == n_layer
             and all(v == {"fwd": 2, "bwd": 2} for v in per_block.values()))
    outside_pc = per_collective(outside)
    return {
        "all_reduce_bytes_B*T*C*4": btc,
        "expected_inside_blocks": expected,
        "plan_inside_blocks": plan_inside,
        "all_reduces_per_block": dict(per_block),
        "free_conversions_inside_blocks": [_brief(c) for c in inside if c not in costly_inside],
        "outside_blocks": [_brief(c) for c in outside],
        "outside_blocks_per_collective": outside_pc,
        "expected_total": _add(expected, outside_pc),
        "plan_matches_closed_form": match,
    }


def _strip(pc):
    return {ph: {k: {"calls": v["calls"], "bytes": float(v["bytes"])} for k, v in d.items() if v["calls"]}
            for ph, d in pc.items()}


def _add(a, b):
    out = {ph: {k: dict(v) for k, v in d.items()} for ph, d in a.items()}
    for ph, d in b.items():
        for k, v in d.items():
            e = out.setdefault(ph, {}).setdefault(k, {"calls": 0, "bytes": 0.0})
            e["calls"] += v["calls"]
            e["bytes"] += v["bytes"]
    return out


def _brief(c) -> str:
    extra = "" if c["requires_grad"] else ", no grad"
    cost = f"{c['fwd_bytes'] + c['bwd_bytes']:.0f} B"
    return f"{c['steps'][0]}({c['value']} {c['src']}->{c['dst']}{extra}) for {c['consumer']} [{c['module']}]: {cost}"


# -- per process ----------------------------------------------------------------------------------

def _measure_one(rank, args, policy, t):
    from nnscaler import parallelize
    from nnscaler.runtime import comm
    base = base_model(args)
    b0 = batch(args, 0)
    ref_loss = base(**b0).item()
    pm = parallelize(copy.deepcopy(base), b0, policy, compute_config(policy, t, args.seed),
                     gen_savedir=args.gen_dir, instance_name=f"{policy}_tp{t}", reuse="override")
    losses = []

    def step(i):
        for p in pm.parameters():
            p.grad = None
        bt = batch(args, i)
        with comm.count_collectives() as fs:
            loss = pm(**bt)
        with comm.count_collectives() as bs:
            loss.backward()
        losses.append(loss.item())
        return fs.snapshot(), bs.snapshot()

    for i in range(args.warmup):
        step(i)
    measured = [step(args.warmup + i) for i in range(args.steps)]
    first_loss = losses[0]
    dist.barrier()
    return {"fwd": measured[0][0], "bwd": measured[0][1],
            "steps_identical": all(m == measured[0] for m in measured),
            "loss_step0": first_loss, "ref_loss_step0": ref_loss,
            "reducer": pm.reducer is not None}


def worker(rank: int, args, t: int, result_file: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), RANK=str(rank),
                      WORLD_SIZE=str(t), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(t))
    if args.force_fallback:
        os.environ["NNSCALER_COMM_FALLBACK"] = ",".join(args.force_fallback)
    torch.set_num_threads(max(1, _common.cpu_count() // t))
    dist.init_process_group("gloo", rank=rank, world_size=t)
    try:
        mine = {p: _measure_one(rank, args, p, t) for p in args.policies}
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


def _emitted_calls(gen_dir: str, instance: str, rank: int) -> Counter:
    paths = list(Path(gen_dir).glob(f"**/{instance}/gencode{rank}.py"))
    if not paths:
        return Counter()
    return Counter(re.findall(r"nr\.comm\.(\w+)\(", paths[0].read_text()))


def _measured_split(snap: dict):
    """(native {name: {calls, bytes}}, fallbacks {name: {calls, bytes}})."""
    native = {k: v for k, v in snap.items() if not k.endswith(FALLBACK)}
    fb = {k: v for k, v in snap.items() if k.endswith(FALLBACK)}
    return native, fb


def _fmt_b(b: float) -> str:
    return f"{b:,.0f}"


# -- ZeRO stage 1: bytes per step, all-reduce against reduce-scatter -----------------------------

# variant: (use_zero, zero_use_reduce_scatter, zero_ngroups)
ZERO_VARIANTS = {
    "dp": (False, False, 1),
    "zero-ar": (True, False, 1),
    "zero-rs": (True, True, 1),
    "zero-rs-g2": (True, True, 2),
}


def _zero_variants(n: int):
    return [v for v, (_, _, g) in ZERO_VARIANTS.items() if n % g == 0 and n // g >= 2 and (g == 1 or n >= 4)]


def _measure_zero_variant(rank, args, variant, n):
    from nnscaler import ComputeConfig, build_optimizer, parallelize
    from nnscaler.runtime import comm
    use_zero, rs, g = ZERO_VARIANTS[variant]
    cfg = ComputeConfig(1, n, use_zero=use_zero, zero_use_reduce_scatter=rs, zero_ngroups=g, trace_strategy="cpu")
    pm = parallelize(base_model(args), batch(args, 0), "dp", cfg, gen_savedir=args.gen_dir,
                     instance_name=f"{variant.replace('-', '_')}_dp{n}", reuse="override")
    opt = build_optimizer(pm, torch.optim.Adam, lr=1e-3)

    def step(i):
        opt.zero_grad()
        bt = batch(args, i * n + rank)  # each replica its own batch
        with comm.count_collectives() as bs:
            loss = pm(**bt)
            loss.backward()
        with comm.count_collectives() as ss:
            opt.step()
        return bs.snapshot(), ss.snapshot()

    for i in range(args.warmup):
        step(i)
    measured = [step(args.warmup + i) for i in range(args.steps)]
    params = [p for p in pm.parameters() if p.requires_grad]
    e = params[0].element_size()
    out = {"fwd_bwd": measured[0][0], "step": measured[0][1],
           "steps_identical": all(m == measured[0] for m in measured),
           "grad_bytes": sum(p.numel() * e for p in params), "param_bytes": sum(p.numel() * e for p in params),
           "n_params": len(params), "elem": e, "reducer": pm.reducer is not None,
           "reducer_buckets": [[b.numel, len(b.params)] for b in getattr(pm.reducer, "_buckets", [])],
           "layout": None}
    lay = opt.zero_layout
    if lay is not None:
        out["layout"] = {"group_size": lay.group_size, "ngroups": lay.ngroups, "padding": lay.padding,
                         "buckets": [[b.numel, b.padded_numel, b.shard_numel, len(b.tensors), b.reduce_scatter]
                                     for b in lay.buckets]}
    dist.barrier()
    return out


def zero_worker(rank: int, args, n: int, result_file: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), RANK=str(rank),
                      WORLD_SIZE=str(n), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(n))
    torch.set_num_threads(max(1, _common.cpu_count() // n))
    dist.init_process_group("gloo", rank=rank, world_size=n)
    try:
        mine = {v: _measure_zero_variant(rank, args, v, n) for v in _zero_variants(n)}
        gathered = [None] * n
        dist.all_gather_object(gathered, mine)
        if rank == 0:
            Path(result_file).write_text(json.dumps(gathered))
    finally:
        from nnscaler.runtime.grid import RankGrid
        RankGrid.destroy_all()
        dist.destroy_process_group()


def _zero_group_size(key: str, n: int, z: int, g: int) -> int:
    base = _base(key)
    if base == "dp_all_reduce":
        return n
    if base == "zero_all_reduce":
        return g  # the cross group: one rank per zero group
    return z  # zero_reduce_scatter / zero_all_gather: within the zero group


def _zero_wire(key: str, payload: float, n: int, z: int, g: int) -> float:
    m = _zero_group_size(key, n, z, g)
    ran = {"dp_all_reduce": "all_reduce", "zero_all_reduce": "all_reduce", "zero_reduce_scatter": "reduce_scatter",
           "zero_all_gather": "all_gather", "zero_reduce_scatter(fallback)": "all_reduce",
           "zero_all_gather(fallback)": "all_gather"}.get(key, key)
    return wire_bytes(ran, payload, m)


def _zero_analytic(variant: str, n: int, r: dict) -> dict:
    """{key: (ideal payload, exact payload, ideal wire)} of one step, per rank. Ideal: G = P = 4 Psi, no
    padding, no flags; exact: with the layout's padding and the one-element "has a gradient" flags
    (reducer: per parameter; reduce-scatter: per tensor and row; cross all-reduce: per tensor)."""
    use_zero, rs, g = ZERO_VARIANTS[variant]
    z = n // g if use_zero else 1
    G, P, e = r["grad_bytes"], r["param_bytes"], r["elem"]
    out = {}
    if not rs:
        exact = sum((numel + k) * e for numel, k in r["reducer_buckets"]) if r["reducer_buckets"] else G
        out["dp_all_reduce"] = (G, exact, 2 * (n - 1) / n * G)
    if use_zero:
        bk = r["layout"]["buckets"]
        if rs:
            out["zero_reduce_scatter"] = (G, sum((padded + z * k) * e for _, padded, _, k, _ in bk),
                                          (z - 1) / z * G)
            if g > 1:
                out["zero_all_reduce"] = (G / z, sum((shard + k) * e for _, _, shard, k, _ in bk),
                                          2 * (g - 1) / g * G / z)
        out["zero_all_gather"] = (P / z, sum(shard * e for _, _, shard, _, _ in bk), (z - 1) / z * P)
    return out


def run_zero(args, n: int, tmp: str) -> list:
    args.port = _free_port()
    result_file = os.path.join(tmp, f"result_zero_dp{n}.json")
    t0 = time.perf_counter()
    mp.spawn(zero_worker, args=(args, n, result_file), nprocs=n)
    spawn_s = time.perf_counter() - t0
    per_rank = json.loads(Path(result_file).read_text())
    print(f"\n== ZeRO stage 1, policy dp, dp {n} ({n} gloo processes x {max(1, _common.cpu_count() // n)} "
          f"thread(s), {spawn_s:.1f} s): one step = zero_grad + forward + backward + opt.step() ==")
    cases = []
    for variant in _zero_variants(n):
        use_zero, rs, g = ZERO_VARIANTS[variant]
        z = n // g if use_zero else 1
        ranks = [r[variant] for r in per_rank]
        r0 = ranks[0]
        G, P = r0["grad_bytes"], r0["param_bytes"]
        an = _zero_analytic(variant, n, r0)
        rows = []
        worst = {"payload": 0.0, "wire": 0.0}
        meas_rank = []
        for r in ranks:
            snap = {}
            for ph in ("fwd_bwd", "step"):
                for k, v in r[ph].items():
                    s = snap.setdefault(k, {"calls": 0, "bytes": 0, "phase": set()})
                    s["calls"] += v["calls"]
                    s["bytes"] += v["bytes"]
                    s["phase"].add(ph)
            meas_rank.append(snap)
        keys = sorted(set(an) | {k for s in meas_rank for k in s})
        for k in keys:
            ms = [s.get(k, {"calls": 0, "bytes": 0, "phase": set()}) for s in meas_rank]
            m = max(ms, key=lambda x: x["bytes"])
            ideal, exact, iwire = an.get(_base(k), (0.0, 0.0, 0.0))
            mwire = _zero_wire(k, m["bytes"], n, z, g)
            rows.append([k, "+".join(sorted(m["phase"])) or "-", m["calls"], _fmt_b(m["bytes"]), _fmt_b(exact),
                         f"{m['bytes'] / exact:.4f}" if exact else "-", _fmt_b(ideal),
                         f"{m['bytes'] / ideal:.4f}" if ideal else "-", _fmt_b(mwire), _fmt_b(iwire),
                         f"{mwire / iwire:.4f}" if iwire else "-"])
        tot_pay = max(sum(v["bytes"] for v in s.values()) for s in meas_rank)
        tot_wire = max(sum(_zero_wire(k, v["bytes"], n, z, g) for k, v in s.items()) for s in meas_rank)
        a_ideal = sum(v[0] for v in an.values())
        a_exact = sum(v[1] for v in an.values())
        a_wire = sum(v[2] for v in an.values())
        rows.append(["total", "", sum(v["calls"] for v in meas_rank[0].values()), _fmt_b(tot_pay), _fmt_b(a_exact),
                     f"{tot_pay / a_exact:.4f}", _fmt_b(a_ideal), f"{tot_pay / a_ideal:.4f}", _fmt_b(tot_wire),
                     _fmt_b(a_wire), f"{tot_wire / a_wire:.4f}"])
        ddp_wire = 2 * (n - 1) / n * G
        print(f"\n-- {variant} (use_zero={use_zero}, zero_use_reduce_scatter={rs}, zero_ngroups={g}, z={z}); "
              f"G = P = {_fmt_b(G)} B per rank; reducer attached: {r0['reducer']} --")
        print(_common.table(["collective", "phase", "calls", "payload B", "exact", "ratio", "ideal", "ratio",
                             "wire B", "ring optimum", "ratio"], rows))
        pad = r0["layout"]["padding"] if r0["layout"] else 0
        print(f"wire / DDP's gradient all-reduce 2(n-1)/n*G = {_fmt_b(ddp_wire)} B: {tot_wire / ddp_wire:.3f}; "
              f"layout padding {pad} elements; counted steps identical: {all(r['steps_identical'] for r in ranks)}")
        cases.append({"variant": variant, "dp": n, "use_zero": use_zero, "zero_use_reduce_scatter": rs,
                      "zero_ngroups": g, "z": z, "G_bytes": G, "P_bytes": P,
                      "analytic": {k: {"ideal_payload": v[0], "exact_payload": v[1], "ring_wire": v[2]}
                                   for k, v in an.items()},
                      "analytic_total": {"ideal_payload": a_ideal, "exact_payload": a_exact, "ring_wire": a_wire},
                      "measured_per_rank": [{"fwd_bwd": r["fwd_bwd"], "step": r["step"]} for r in ranks],
                      "measured_payload_per_rank_max": tot_pay, "measured_wire_per_rank_max": tot_wire,
                      "ratio_payload_exact": tot_pay / a_exact, "ratio_payload_ideal": tot_pay / a_ideal,
                      "ratio_wire_ring_optimum": tot_wire / a_wire, "wire_over_ddp_all_reduce": tot_wire / ddp_wire,
                      "layout": r0["layout"], "reducer_buckets": r0["reducer_buckets"],
                      "steps_identical": all(r["steps_identical"] for r in ranks), "spawn_seconds": spawn_s})
    return cases


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, nargs="*", default=[2, 4], help="tensor-parallel degrees (default 2 4; none: skip)")
    p.add_argument("--policies", nargs="+", default=["megatron", "tp"], help="default: megatron tp")
    p.add_argument("--seed", type=int, default=1, help="pas_config seed of the `tp` policy (default 1)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--embd", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--block-size", type=int, default=64, help="sequence length T")
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--batch", type=int, default=8, help="sequences per step B (every rank of the unit)")
    p.add_argument("--warmup", type=int, default=1, help="uncounted steps first (default 1)")
    p.add_argument("--steps", type=int, default=1, help="counted steps (default 1; all must count alike)")
    p.add_argument("--force-fallback", nargs="*", default=[],
                   help="collectives to run through their fallbacks (NNSCALER_COMM_FALLBACK), e.g. all")
    p.add_argument("--zero-dp", type=int, nargs="*", default=[2, 4],
                   help="data-parallel degrees of the ZeRO part (default 2 4; none: skip)")
    p.add_argument("--out", default=str(_common.RESULTS_DIR / "comm.json"))
    args = p.parse_args()
    if any(n < 2 for n in args.zero_dp):
        p.error("--zero-dp degrees must be >= 2")
    if any(t < 2 for t in args.tp):
        p.error("--tp degrees must be >= 2")
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    cores = _common.cpu_count()
    load_before = _common.loadavg()
    t_start = time.perf_counter()
    print(f"comm: GPT n_layer={args.layers} n_embd={args.embd} n_head={args.heads} T={args.block_size} "
          f"vocab={args.vocab} B={args.batch}; policies {args.policies} (tp seed {args.seed}); tp {args.tp}; "
          f"{args.warmup} warm-up + {args.steps} counted step(s); {cores} cores", flush=True)

    cases = []
    with tempfile.TemporaryDirectory(prefix="nnscaler_bench_comm_") as tmp:
        args.gen_dir = os.path.join(tmp, "gen")
        for t in args.tp:
            # the plan, in this process
            plans = {}
            for policy in args.policies:
                graph, unit = planned_graph(args, policy, t)
                convs = plan_conversions(graph, unit)
                for c in convs:
                    c["_n"] = t
                plans[policy] = (graph, convs)
            # the measurement, t processes
            args.port = _free_port()
            result_file = os.path.join(tmp, f"result_tp{t}.json")
            t0 = time.perf_counter()
            mp.spawn(worker, args=(args, t, result_file), nprocs=t)
            spawn_s = time.perf_counter() - t0
            per_rank = json.loads(Path(result_file).read_text())
            for policy in args.policies:
                graph, convs = plans[policy]
                cases.append(_report(args, policy, t, graph, convs, [r[policy] for r in per_rank],
                                     _emitted_calls(args.gen_dir, f"{policy}_tp{t}", 0), spawn_s))
        zero_cases = [c for n in args.zero_dp for c in run_zero(args, n, tmp)]
    wall = time.perf_counter() - t_start

    print()
    rows = []
    for c in cases:
        rows.append([f"{c['policy']} tp{c['tp']}", c["measured_calls_per_rank"], c["analytic"]["total"]["calls"],
                     _fmt_b(c["measured_bytes_per_rank_max"]), _fmt_b(c["analytic"]["total"]["bytes"]),
                     f"{c['ratio_max']:.3f}", _fmt_b(c["analytic_naive"]["total"]["bytes"]),
                     _fmt_b(c["measured_wire_bytes_per_rank_max"]), _fmt_b(c["analytic_ring_bytes"]), c["fallback_calls"],
                     "ok" if c["ratio_max"] <= TARGET_RATIO else "ABOVE"])
    if zero_cases:
        zrows = [[f"{c['variant']} dp{c['dp']}", c["z"], _fmt_b(c["G_bytes"]),
                  _fmt_b(c["measured_payload_per_rank_max"]), _fmt_b(c["analytic_total"]["exact_payload"]),
                  f"{c['ratio_payload_exact']:.4f}", f"{c['ratio_payload_ideal']:.4f}",
                  _fmt_b(c["measured_wire_per_rank_max"]), _fmt_b(c["analytic_total"]["ring_wire"]),
                  f"{c['ratio_wire_ring_optimum']:.4f}", f"{c['wire_over_ddp_all_reduce']:.3f}"] for c in zero_cases]
        print(_common.table(["ZeRO case", "z", "G B", "payload B", "exact", "ratio", "vs ideal", "wire B",
                             "ring optimum", "ratio", "wire / DDP AR"], zrows))
        print("ZeRO: per rank per step (backward + opt.step()); payload = stats convention (all-reduce B, "
              "reduce-scatter B, all-gather B/n); exact = with layout padding and has-grad flags; ideal = G = P = "
              "4 Psi; wire = ring bytes sent per rank (all-reduce 2(n-1)/n B, reduce-scatter / all-gather (n-1)/n B) "
              "over each collective's group; ring optimum: DDP 2(n-1)/n G, ZeRO all-reduce 2(n-1)/n G + (n-1)/n P, "
              "ZeRO reduce-scatter (n-1)/n G + (n-1)/n P (+ 2(g-1)/g G/z across groups)")
        print()
    if rows:
        print(_common.table(["plan", "calls", "plan calls", "measured B/rank", "analytic B", "ratio",
                             "naive analytic B", "wire B", "analytic wire B", "fallbacks", f"<= {TARGET_RATIO}"], rows))
    print("per rank per step (forward + backward); ratio = measured/analytic (payload bytes), worst rank; "
          "naive: backward of conversions of no-grad values counted too; wire: bytes sent with ring / pairwise "
          "algorithms (measured: derived from the recorded payloads, fallbacks as the collective they ran)")
    print(f"load average before/after: {load_before} / {_common.loadavg()}; total wall time {wall:.1f} s")

    data = {
        "timestamp": _common.timestamp(),
        "command": _common.command_line(),
        "machine": _common.machine_info(),
        "config": {"tp": args.tp, "policies": args.policies, "tp_seed": args.seed, "backend": "gloo",
                   "threads_per_rank": {str(t): max(1, cores // t) for t in args.tp},
                   "model": {"n_layer": args.layers, "n_embd": args.embd, "n_head": args.heads,
                             "block_size": args.block_size, "vocab_size": args.vocab, "use_sdpa": False},
                   "batch": args.batch, "warmup_steps": args.warmup, "counted_steps": args.steps,
                   "force_fallback": args.force_fallback, "cost_model": "payload"},
        "target_ratio": TARGET_RATIO,
        "cases": cases,
        "zero": {"dp": args.zero_dp, "policy": "dp", "optimizer": "torch.optim.Adam via build_optimizer",
                 "step": "zero_grad + forward + backward + opt.step()",
                 "payload_convention": "runtime/comm/stats.py: all-reduce B, reduce-scatter B, all-gather B/n",
                 "wire_convention": "ring bytes sent per rank over the collective's group",
                 "cases": zero_cases},
        "loadavg_before_after": [load_before, _common.loadavg()],
        "wall_seconds": wall,
    }
    path = Path(args.out)
    if path.resolve().parent == _common.RESULTS_DIR.resolve():
        path = _common.write_json(path.name, data)
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {path}")


def _report(args, policy, t, graph, convs, ranks, emitted, spawn_s) -> dict:
    analytic = per_collective(convs)
    naive = per_collective(convs, naive=True)
    a_tot = totals(analytic)
    n_tot = totals(naive)
    ring = sum(c["ring_bytes"] for c in convs)
    print(f"\n== {policy} tp{t} ({t} gloo processes x {max(1, _common.cpu_count() // t)} thread(s), "
          f"{spawn_s:.1f} s) ==")
    r0 = ranks[0]
    print(f"step-0 loss {r0['loss_step0']:.6f} (single device {r0['ref_loss_step0']:.6f}, "
          f"diff {abs(r0['loss_step0'] - r0['ref_loss_step0']):.1e}); data-parallel reducer: "
          f"{'yes' if r0['reducer'] else 'none (dp degree 1)'}; counted steps identical: "
          f"{all(r['steps_identical'] for r in ranks)}")

    per_rank = []
    for i, r in enumerate(ranks):
        nat = {ph: _measured_split(r[ph])[0] for ph in ("fwd", "bwd")}
        fb = {ph: _measured_split(r[ph])[1] for ph in ("fwd", "bwd")}
        calls = sum(v["calls"] for ph in ("fwd", "bwd") for v in r[ph].values())
        b = sum(v["bytes"] for ph in ("fwd", "bwd") for v in r[ph].values())
        wire = sum(wire_bytes(k, v["bytes"], t) for ph in ("fwd", "bwd") for k, v in r[ph].items())
        per_rank.append({"rank": i, "native": nat, "fallback": fb, "calls": calls, "bytes": b,
                         "wire_bytes": wire,
                         "ratio": b / a_tot["bytes"] if a_tot["bytes"] else (1.0 if b == 0 else float("inf"))})
    rows = []
    names = sorted({k for ph in ("fwd", "bwd") for k in analytic[ph]} |
                   {_base(k) for r in ranks for ph in ("fwd", "bwd") for k in r[ph]})
    for name in names:
        for ph in ("fwd", "bwd"):
            a = analytic[ph].get(name, {"calls": 0, "bytes": 0.0})
            ms = [_folded(r[ph], name) for r in ranks]  # native + fallback of `name`
            if not a["calls"] and not any(m["calls"] for m in ms):
                continue
            same = all(m == ms[0] for m in ms)
            m = ms[0]
            ratio = f"{m['bytes'] / a['bytes']:.3f}" if a["bytes"] else ("-" if not m["bytes"] else "inf")
            rows.append([name, ph, m["calls"] if same else "/".join(str(x["calls"]) for x in ms), a["calls"],
                         _fmt_b(m["bytes"]) if same else "/".join(_fmt_b(x["bytes"]) for x in ms),
                         _fmt_b(a["bytes"]), ratio, m["fallback_calls"]])
    worst = max(per_rank, key=lambda x: x["ratio"])
    rows.append(["total", "", worst["calls"], a_tot["calls"], _fmt_b(worst["bytes"]), _fmt_b(a_tot["bytes"]),
                 f"{worst['ratio']:.3f}", sum(r[-1] for r in rows)])
    print(_common.table(["collective", "pass", "calls/rank", "plan calls", "measured bytes/rank",
                         "analytic bytes", "ratio", "of which fallback"], rows))
    fallbacks = {f"{ph}:{k}": v for r in per_rank[:1] for ph in ("fwd", "bwd") for k, v in r["fallback"][ph].items()}
    fb_calls = sum(v["calls"] for v in fallbacks.values())
    print(f"ratio measured/analytic per rank: " + ", ".join(f"r{x['rank']} {x['ratio']:.3f}" for x in per_rank)
          + f" (target <= {TARGET_RATIO}); fallbacks: " + (", ".join(f"{k} x{v['calls']} ({_fmt_b(v['bytes'])} B)"
                                                             for k, v in fallbacks.items()) or "none"))
    wire = max(x["wire_bytes"] for x in per_rank)
    print(f"naive analytic (backward of no-grad conversions counted too): {_fmt_b(n_tot['bytes'])} B, "
          f"{n_tot['calls']} calls; wire bytes (ring / pairwise algorithms): measured {_fmt_b(wire)} B, "
          f"analytic {_fmt_b(ring)} B")

    # emitted adapter calls (rank 0's file) against the plan's conversions
    planned_steps = Counter(s for c in convs for s in c["steps"])
    emitted_ok = emitted == planned_steps
    print(f"generated nr.comm calls (gencode0.py): {dict(sorted(emitted.items()))} -> "
          f"{'match the plan' if emitted_ok else 'DIFFER from the plan ' + str(dict(planned_steps))}")
    inert = Counter(_inert_reason(c) for c in convs if not (c["fwd_collectives"] or c["bwd_collectives"]))
    if inert:
        print("conversions with no collective at run time: " + ", ".join(f"{k} x{v}" for k, v in sorted(inert.items())))

    costly = sorted([c for c in convs if c["fwd_bytes"] + c["bwd_bytes"] > 0],
                    key=lambda c: -(c["fwd_bytes"] + c["bwd_bytes"]))
    by_step = defaultdict(lambda: [0, 0.0])
    for c in costly:
        by_step[c["steps"][0]][0] += 1
        by_step[c["steps"][0]][1] += c["fwd_bytes"] + c["bwd_bytes"]
    print("analytic bytes by adapter: " + ", ".join(f"{k} x{v[0]} {_fmt_b(v[1])} B ({v[1] / a_tot['bytes']:.0%})"
                                                    for k, v in sorted(by_step.items(), key=lambda kv: -kv[1][1])))

    closed = None
    if policy == "megatron":
        closed = megatron_closed_form(args, convs, args.layers)
        exp = closed["expected_total"]
        print(f"closed form: per block 1 all-reduce of B*T*C*4 = {_fmt_b(closed['all_reduce_bytes_B*T*C*4'])} B "
              f"after attention + 1 after the MLP in forward, the same 2 in backward -> "
              + "; ".join(f"{ph} " + ", ".join(f"{k} x{v['calls']} {_fmt_b(v['bytes'])} B" for k, v in d.items())
                          for ph, d in exp.items()))
        print("  outside the blocks: " + ("; ".join(closed["outside_blocks"]) or "nothing"))
        print("  free conversions inside the blocks: " + "; ".join(sorted(set(
            re.sub(r"h\.\d+\.", "h.*.", re.sub(r"_\d+ ", " ", s)) for s in closed["free_conversions_inside_blocks"]))))
        print(f"  plan-derived counts match the closed form: {closed['plan_matches_closed_form']}; "
              f"measured == closed form: {_strip(_measured_pc(ranks[0])) == _strip(exp)}")
    return {
        "policy": policy, "tp": t, "pas_config": {"seed": args.seed} if policy == "tp" else {},
        "analytic": {"per_collective": analytic, "total": a_tot},
        "analytic_naive": {"per_collective": naive, "total": n_tot},
        "analytic_ring_bytes": ring,
        "measured_wire_bytes_per_rank_max": wire,
        "measured_per_rank": per_rank,
        "measured_calls_per_rank": worst["calls"],
        "measured_bytes_per_rank_max": max(x["bytes"] for x in per_rank),
        "ratio_per_rank": [x["ratio"] for x in per_rank],
        "ratio_max": worst["ratio"],
        "fallbacks": fallbacks, "fallback_calls": fb_calls,
        "loss_step0": r0["loss_step0"], "ref_loss_step0": r0["ref_loss_step0"],
        "steps_identical": all(r["steps_identical"] for r in ranks),
        "emitted_calls_rank0": dict(emitted), "emitted_match_plan": emitted_ok,
        "analytic_bytes_by_adapter": {k: {"conversions": v[0], "bytes": v[1]} for k, v in by_step.items()},
        "conversions": [{k: v for k, v in c.items() if not k.startswith("_")} for c in convs],
        "megatron_closed_form": closed,
        "spawn_seconds": spawn_s,
    }


def _base(key: str) -> str:
    return key[:-len(FALLBACK)] if key.endswith(FALLBACK) else key


def _folded(snap: dict, name: str) -> dict:
    nat = snap.get(name, {"calls": 0, "bytes": 0})
    fb = snap.get(name + FALLBACK, {"calls": 0, "bytes": 0})
    return {"calls": nat["calls"] + fb["calls"], "bytes": nat["bytes"] + fb["bytes"], "fallback_calls": fb["calls"]}


def wire_bytes(key: str, payload: float, n: int) -> float:
    """Bytes one rank sends on the wire for a recorded (key, payload bytes), ring / pairwise
    algorithms. A fallback records the payload of the collective it really ran (stats.py):
    reduce_scatter(fallback) an all-reduce of B, all_to_all(fallback) and all_gather(fallback)
    an all-gather of the local piece."""
    ran = {"reduce_scatter" + FALLBACK: "all_reduce", "all_to_all" + FALLBACK: "all_gather",
           "all_gather" + FALLBACK: "all_gather"}.get(key, _base(key))
    if ran == "all_reduce":
        return 2 * (n - 1) / n * payload  # payload = B
    if ran == "all_gather":
        return (n - 1) * payload  # payload = B/n, wire (n-1)/n*B
    if ran == "reduce_scatter":
        return (n - 1) / n * payload  # payload = B
    if ran == "all_to_all":
        return (n - 1) / n * payload  # payload = B/n, wire (n-1)/n*B/n
    return float("nan")


def _inert_reason(c) -> str:
    if c["identity_at_runtime"]:
        return f"{c['steps'][0]} (same dim once normalised: identity)"
    if c["naive_bwd_collectives"]:
        return f"{c['steps'][0]} of a no-grad {c['dtype']} value (its backward never runs)"
    return f"{c['steps'][0]} (no communication by design)"


def _measured_pc(rank_result) -> dict:
    return {ph: {k: {"calls": v["calls"], "bytes": float(v["bytes"])} for k, v in rank_result[ph].items()}
            for ph in ("fwd", "bwd")}


if __name__ == "__main__":
    main()
