"""Pipeline schedules on real gloo processes: measured bubble and per-stage activation memory.

    python bench/pipeline.py                 # 4 ranks, 4 stages (interleaved: 8 on 4)
    python bench/pipeline.py --ranks 2       # 2 ranks, 2 stages (interleaved: 4 on 2)

Model: a stack of `--layers` residual MLP blocks (width `--width`, hidden 4x) ending in an MSE
loss; compute-heavy (two d x 4d matmuls per block) with little to send between stages (one
mb x d activation / gradient per micro-batch). Policy `pp` (`ComputeConfig(R, R)`, R = `--ranks`,
`pipeline_pivots='Block'`: stages cut at block boundaries, balanced by op count), one module per
schedule, all built in the same R processes (1 intra-op thread each, or cores // R).

Per schedule: `--warmup` train steps, then `--steps` measured ones, a barrier before each. From
the executor's own `last_timeline` ((action, start, end), perf_counter = CLOCK_MONOTONIC, common to
the processes) and the time each action spent blocked in a receive (the bench wraps this rank's
`Mailbox.recv_tensor` / `recv_int`; a timeline span includes that wait), per step:

    busy(rank)  = sum over its actions of (end - start - receive wait)
    bubble      = 1 - sum_rank busy / (R * (max end - min start))

reported as the median over steps, next to `schedule.analytic_bubble()` ((p-1)/(m+p-1) for 1f1b
and gpipe; None for chimera) and `schedule.bubble_fraction()` (unit-cost simulation, B = 2F).
`bubble_spans` is the same without removing the receive waits (gaps between actions only).

Activation memory: the executor's `track_activations` counts the bytes autograd saves per stage
forward (distinct storages, parameters excluded) until its backward; `peak_activation_bytes` per
rank over one measured step. Prediction: replay the rank's action list with the bytes measured
for each stage's forward (`peak_inflight(d)` x per-micro bytes with one stage per device).

Caveat: R processes on fewer cores oversubscribe the CPU (4 ranks on 2 cores: while all four
stages compute, each runs at about half speed), so wall-clock bubbles are noisy and biased low
against the analytic value; `--ranks 2` gives each rank a core. Writes bench/results/pipeline.json
(`pipeline_r2.json` with `--ranks 2`).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

SCHEDULES = {4: ["1f1b", "1f1b_plus", "gpipe", "chimera_direct", "1f1b_interleaved"],
             2: ["1f1b", "1f1b_plus", "gpipe", "1f1b_interleaved"]}


class Block(torch.nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.fc = torch.nn.Linear(d, 4 * d)
        self.proj = torch.nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.proj(torch.nn.functional.gelu(self.fc(x)))


class MLPStack(torch.nn.Module):
    def __init__(self, d: int, layers: int):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(d) for _ in range(layers))

    def forward(self, x, y):
        for b in self.blocks:
            x = b(x)
        return torch.nn.functional.mse_loss(x, y)


def make_model(args):
    torch.manual_seed(0)
    return MLPStack(args.width, args.layers)


def micro_batch(args, step: int, micro: int):
    g = torch.Generator().manual_seed(1000 * step + micro)
    return {"x": torch.randn(args.micro_batch, args.width, generator=g),
            "y": torch.randn(args.micro_batch, args.width, generator=g)}


def _wrap_recv(mailbox, waits: list) -> None:
    """Record (start, end) of every blocking receive of this rank's mailbox."""
    for name in ("recv_tensor", "recv_int"):
        orig = getattr(mailbox, name)

        def timed(src, tag, _orig=orig):
            t0 = time.perf_counter()
            try:
                return _orig(src, tag)
            finally:
                waits.append((t0, time.perf_counter()))
        setattr(mailbox, name, timed)


def _wrap_forward(ex, unit: dict) -> None:
    """Record the activation bytes of each stage forward (the executor pops them at backward)."""
    orig = ex._forward

    def forward(a, sample, training):
        orig(a, sample, training)
        if ex.track_activations and training:
            unit[a.stage] = ex._saved_bytes[(a.stage, a.micro)]
    ex._forward = forward


def _worker(rank: int, args) -> dict:
    from nnscaler import ComputeConfig, build_optimizer, parallelize
    R, out = args.ranks, {}
    for sched in args.schedules:
        nstages = 2 * R if sched == "1f1b_interleaved" else R
        pas = {"pipeline_nmicros": args.nmicros, "pipeline_scheduler": sched, "pipeline_nstages": nstages,
               "pipeline_pivots": "Block"}
        cfg = ComputeConfig(R, R, trace_strategy="cpu", use_end2end=True, pas_config=pas)
        t0 = time.perf_counter()
        pm = parallelize(make_model(args), micro_batch(args, 0, 0), "pp", cfg, gen_savedir=args.gen_dir,
                         instance_name=f"pp{R}_{sched}", reuse="override")
        build_s = time.perf_counter() - t0
        opt = build_optimizer(pm, torch.optim.SGD, lr=1e-4)
        ex = pm._executor()
        waits, unit = [], {}
        _wrap_recv(ex.mailbox, waits)
        _wrap_forward(ex, unit)
        steps = []
        for step in range(args.warmup + args.steps):
            measured = step >= args.warmup
            samples = [micro_batch(args, step, i) for i in range(args.nmicros)]
            opt.zero_grad()
            ex.track_activations = measured and step == args.warmup  # one step: the hooks cost time
            ex.peak_activation_bytes = ex.live_activation_bytes = 0
            waits.clear()
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            losses = pm.train_step(samples)
            t1, c1 = time.perf_counter(), time.process_time()
            opt.step()
            if not measured:
                continue
            tl, busy = ex.last_timeline, 0.0
            for _, a0, a1 in tl:
                busy += (a1 - a0) - sum(min(a1, w1) - max(a0, w0) for w0, w1 in waits if w0 < a1 and w1 > a0)
            steps.append({"timeline": tl, "busy_s": busy, "recv_wait_s": sum(w1 - w0 for w0, w1 in waits),
                          "train_step_s": t1 - t0, "cpu_s": c1 - c0, "tracked": ex.track_activations,
                          "peak_activation_bytes": ex.peak_activation_bytes if ex.track_activations else None,
                          "loss": float(torch.stack([o.reshape(()) for o in losses]).mean())})
        out[sched] = {"build_s": build_s, "steps": steps, "stage_act_bytes": unit,
                      "stages_here": sorted(unit), "messages": ex.mailbox.messages}
    return out


def summarize(args, ranks: list) -> dict:
    from nnscaler.ir.schedules import get_schedule
    R, res = args.ranks, {}
    for sched in args.schedules:
        nstages = 2 * R if sched == "1f1b_interleaved" else R
        sc = get_schedule(sched, nstages, args.nmicros, R)
        per = [r[sched] for r in ranks]
        bubbles, spans, walls, computes = [], [], [], []
        for i in range(args.steps):
            if per[0]["steps"][i]["tracked"]:
                continue  # the activation-tracking step runs hooks: not timed
            st = [p["steps"][i] for p in per]
            lo = min(s["timeline"][0][1] for s in st)
            hi = max(s["timeline"][-1][2] for s in st)
            busy = sum(s["busy_s"] for s in st)
            span_busy = sum(a1 - a0 for s in st for _, a0, a1 in s["timeline"])
            bubbles.append(1 - busy / (R * (hi - lo)))
            spans.append(1 - span_busy / (R * (hi - lo)))
            walls.append(hi - lo)
            computes.append(busy / R)
        unit = {int(s): b for p in per for s, b in p["stage_act_bytes"].items()}
        act = []
        for d in range(R):
            cur = pred = 0
            for a in sc.actions(d):
                cur += unit[a.stage] if a.kind == "F" else -unit[a.stage]
                pred = max(pred, cur)
            meas = next(s["peak_activation_bytes"] for s in per[d]["steps"] if s["tracked"])
            act.append({"rank": d, "stages": per[d]["stages_here"], "peak_inflight": sc.peak_inflight(d),
                        "measured_bytes": meas, "predicted_bytes": pred,
                        "measured_over_predicted": meas / pred if pred else None})
        med = _common.median(bubbles)
        ana = sc.analytic_bubble()
        res[sched] = {
            "nstages": nstages, "pp_size": R, "nmicros": args.nmicros,
            "bubble_measured_median": med, "bubble_measured_steps": bubbles,
            "bubble_spans_median": _common.median(spans),
            "bubble_analytic": ana, "bubble_simulated": sc.bubble_fraction(),
            "measured_over_analytic": med / ana if ana else None,
            "measured_over_simulated": med / sc.bubble_fraction(),
            "step_wall_ms_median": 1e3 * _common.median(walls),
            "compute_ms_per_rank_median": 1e3 * _common.median(computes),
            "recv_wait_ms_per_rank": [1e3 * _common.median([s["recv_wait_s"] for s in p["steps"]]) for p in per],
            "build_s": max(p["build_s"] for p in per), "stage_act_bytes_per_micro": unit,
            "activations": act, "losses": [s["loss"] for s in per[0]["steps"]],
            "render": sc.render(),
        }
    if "gpipe" in res:
        for sched, r in res.items():
            for a, g in zip(r["activations"], res["gpipe"]["activations"]):
                a["over_gpipe"] = a["measured_bytes"] / g["measured_bytes"]
    return res


def _f(x, fmt="{:.3f}"):
    return "-" if x is None else fmt.format(x)


def report(args, res: dict) -> None:
    R = args.ranks
    print(f"\n{R} ranks x {args.threads} thread(s) on {_common.cpu_count()} cores, m={args.nmicros}, "
          f"{args.layers} blocks of width {args.width}, micro-batch {args.micro_batch}; median of "
          f"{args.steps - 1} timed steps")
    if R > _common.cpu_count():
        print(f"NOTE: {R} processes on {_common.cpu_count()} cores oversubscribe the CPU: concurrent stages slow "
              f"each other, so wall-clock bubbles are noisy and biased low (try --ranks 2)")
    rows = [[s, f"{r['nstages']}/{r['pp_size']}", f"{r['bubble_measured_median']:.3f}", _f(r["bubble_analytic"]),
             f"{r['bubble_simulated']:.3f}", _f(r["measured_over_analytic"]), f"{r['measured_over_simulated']:.2f}",
             f"{r['bubble_spans_median']:.3f}", f"{r['step_wall_ms_median']:.0f}",
             f"{r['compute_ms_per_rank_median']:.0f}"] for s, r in res.items()]
    print(_common.table(["schedule", "stages/devs", "bubble meas", "analytic", "simulated", "meas/analytic",
                         "meas/sim", "spans only", "step ms", "busy ms/rank"], rows))
    print("\npeak activation bytes per rank (saved for backward; predicted = replay of the action list "
          "with the measured per-stage bytes)")
    rows = []
    for s, r in res.items():
        for a in r["activations"]:
            rows.append([s, a["rank"], ",".join(map(str, a["stages"])), a["peak_inflight"],
                         _common.fmt_bytes(a["measured_bytes"]), _common.fmt_bytes(a["predicted_bytes"]),
                         _f(a["measured_over_predicted"]), _f(a.get("over_gpipe"))])
    print(_common.table(["schedule", "rank", "stages", "peak in-flight", "measured B", "predicted B",
                         "meas/pred", "/ gpipe"], rows))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=4, choices=(2, 4))
    ap.add_argument("--schedules", nargs="*", default=None)
    ap.add_argument("--nmicros", type=int, default=8)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--micro-batch", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=6, help="measured steps; the first one tracks activations")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.schedules = args.schedules or SCHEDULES[args.ranks]
    args.threads = args.threads or _common.threads_per_rank(args.ranks)
    out = args.out or str(_common.RESULTS_DIR / ("pipeline.json" if args.ranks == 4 else f"pipeline_r{args.ranks}.json"))
    load0 = _common.loadavg()
    with tempfile.TemporaryDirectory() as tmp:
        args.gen_dir = tmp
        ranks, spawn_s = _common.spawn_gloo(_worker, (args,), args.ranks, os.path.join(tmp, "result.json"),
                                            threads=args.threads)
    res = summarize(args, ranks)
    report(args, res)
    cfg = {k: v for k, v in vars(args).items() if k != "gen_dir"}
    data = {**_common.run_header(), "config": cfg, "loadavg_before": load0, "loadavg_after": _common.loadavg(),
            "spawn_s": spawn_s, "oversubscribed": args.ranks > _common.cpu_count(), "schedules": res,
            "raw_timelines_rank_step": {s: [r[s]["steps"][-1]["timeline"] for r in ranks] for s in args.schedules}}
    for r in res.values():
        r.pop("render")
    _common.save_results(out, data)
    print(f"total {spawn_s:.0f} s")


if __name__ == "__main__":
    main()
