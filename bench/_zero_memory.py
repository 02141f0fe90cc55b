"""ZeRO stage 1 / data-parallel part of bench/memory.py (`--zero-cases`): per-rank bytes of the
parameters, gradients and optimizer state against Adam fp32 (DDP 16 Psi, ZeRO-1 4 Psi + 4 Psi + 8 Psi / z).
See memory.py's docstring."""
from __future__ import annotations

import os
from collections import defaultdict

import _common
import torch
import torch.distributed as dist

from _common import base_model, batch

_fmt = _common.fmt_bytes


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


def run_zero_case(args, name: str, tmp: str) -> dict:
    plan, dp, use_zero, ngroups, policy = ZERO_CASES[name]
    world = plan * dp
    z = dp // ngroups if use_zero else 1
    ranks, spawn_s = _common.spawn_gloo(_measure_zero, (args, name), world, os.path.join(tmp, f"result_{name}.json"))
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
