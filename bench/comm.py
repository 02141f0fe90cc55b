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
import math
import os
import re
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
from _zero_comm import run_zero  # noqa: E402

TARGET_RATIO = 1.05
FALLBACK = _common.FALLBACK


# -- model and plan -------------------------------------------------------------------------------

base_model = _common.base_model
batch = _common.batch
_fmt_b = _common.fmt_bytes
_base = _common.base_key
wire_bytes = _common.wire_bytes


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


def _measure_all(rank, args, t):
    return {p: _measure_one(rank, args, p, t) for p in args.policies}


# -- launcher -------------------------------------------------------------------------------------

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
    args = _common.parse_args(p, {"tp": [2], "policies": ["megatron"], "zero_dp": [2], "layers": 1, "embd": 16,
                                  "heads": 2, "block_size": 8, "vocab": 32, "batch": 2}, "comm.json")
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
            env = {"NNSCALER_COMM_FALLBACK": ",".join(args.force_fallback)} if args.force_fallback else None
            per_rank, spawn_s = _common.spawn_gloo(_measure_all, (args, t), t,
                                                   os.path.join(tmp, f"result_tp{t}.json"), env=env)
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
        **_common.run_header(),
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
    _common.save_results(args.out, data)


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


def _folded(snap: dict, name: str) -> dict:
    nat = snap.get(name, {"calls": 0, "bytes": 0})
    fb = snap.get(name + FALLBACK, {"calls": 0, "bytes": 0})
    return {"calls": nat["calls"] + fb["calls"], "bytes": nat["bytes"] + fb["bytes"], "fallback_calls": fb["calls"]}


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
