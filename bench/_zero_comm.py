"""ZeRO stage 1 part of bench/comm.py (`--zero-dp`): bytes per step of the ZeRO variants (Reducer
all-reduce against reduce-scatter) against the payload ideal / exact and the ring-wire optimum. See
comm.py's docstring."""
from __future__ import annotations

import os

import _common
import torch
import torch.distributed as dist

from _common import base_model, batch

_fmt_b = _common.fmt_bytes
_base = _common.base_key
wire_bytes = _common.wire_bytes


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


def _measure_zero_all(rank: int, args, n: int) -> dict:
    return {v: _measure_zero_variant(rank, args, v, n) for v in _zero_variants(n)}


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
    per_rank, spawn_s = _common.spawn_gloo(_measure_zero_all, (args, n), n, os.path.join(tmp, f"result_zero_dp{n}.json"))
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
