"""Pipeline schedules on real gloo processes: measured bubble and per-stage activation memory.

    python bench/pipeline.py                 # 4 ranks, 4 stages (interleaved: 8 on 4) -> pipeline.json
    python bench/pipeline.py --ranks 2       # 2 ranks, 2 stages (interleaved: 4 on 2) -> pipeline_r2.json

Model: `--layers` (8) residual MLP blocks (width `--width` 512, hidden 4x, micro-batch 64) and an
MSE loss: two mb x d x 4d matmuls per block, one mb x d tensor between stages. Policy `pp`,
`ComputeConfig(R, R, use_end2end=True)`, R = `--ranks`, `pipeline_pivots='Block'`, `--nmicros` (8)
micro-batches; one module per schedule, all in the same R gloo processes (cores // R threads, >= 1).

`--warmup` (1) step, one step with `track_activations`, then `--steps` (8) timed steps, every
schedule once per round (rotated), a barrier before each. From the executor's `last_timeline` ((action, start, end) from
perf_counter, CLOCK_MONOTONIC, common to the processes) less the time each action spent blocked in
a receive (the bench wraps the rank's `Mailbox.recv_*`; a timeline span includes that wait):

    busy(rank) = sum over its actions of (end - start - receive wait)
    bubble     = 1 - sum over ranks of busy / (R * (max end - min start))

median over steps, against `analytic_bubble()` ((p-1)/(m+p-1) for 1f1b and gpipe, (p-1)/(vm+p-1)
interleaved, None for chimera) and `bubble_fraction(schedule)` (unit-cost simulation, B = 2F). Also: the
bubble from the spans alone (no wait removed), the bubble of the action lists replayed with each
action's measured thread CPU time and free communication ("replay cpu": what the measured costs
allow without contention or latency), on-CPU share of busy time, speed-up over the unpipelined
model stepped by rank 0 alone (the others wait at a barrier) once per round.

Activation memory: `track_activations` counts the bytes autograd saves per stage forward (distinct
storages, parameters excluded) until its backward; `peak_activation_bytes` per rank over the step,
against the theory: the rank's action list replayed with 36 mb d bytes per block per micro-batch
(fc input d, gelu and proj inputs 4d each, fp32) + 8 mb d for the loss (input and target), i.e.
`peak_inflight(schedule, d)` x stage bytes with one stage per device; and the ratio to gpipe. Not counted
there: the tensors this rank sent and still holds (until the schedule proves them delivered);
their peak ("sends held") is reported next to all the bytes sent in the step ("sent").

Caveat: more ranks than cores (4 on 2) oversubscribe the CPU: concurrent stages slow each other and
a rank woken by a message may wait for a core, so wall-clock bubbles are noisy; `--ranks 2` gives
each rank a core. Other load on the machine skews them too (load averages are recorded).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402
from schedule_report import bubble_fraction, peak_inflight  # noqa: E402

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


def _instrument(ex, waits: list, cpu: dict, unit: dict) -> None:
    """Wrap this rank's executor (instance attributes only): (start, end) of every blocking receive
    into `waits`; thread CPU seconds of every action into `cpu`; the activation bytes of each stage
    forward into `unit` when tracking (the executor pops them at the backward)."""
    for name in ("recv_tensor", "recv_int"):
        def timed(src, tag, _orig=getattr(ex.mailbox, name)):
            t0 = time.perf_counter()
            try:
                return _orig(src, tag)
            finally:
                waits.append((t0, time.perf_counter()))
        setattr(ex.mailbox, name, timed)
    fwd, bwd = ex._forward, ex._backward

    def forward(a, sample, training):
        c0 = time.thread_time()
        fwd(a, sample, training)
        cpu[str(a)] = time.thread_time() - c0
        if ex.track_activations and training:
            unit[a.stage] = ex._saved_bytes[(a.stage, a.micro)]

    def backward(a, *rest):
        c0 = time.thread_time()
        bwd(a, *rest)
        cpu[str(a)] = time.thread_time() - c0
    ex._forward, ex._backward = forward, backward


def _worker(rank: int, args) -> dict:
    """Build one module per schedule, then run the steps in rounds (every schedule once per round,
    so load drifts on the machine hit them alike)."""
    from nnscaler import ComputeConfig, build_optimizer, parallelize
    R, runs = args.ranks, {}
    for sched in args.schedules:
        nstages = 2 * R if sched == "1f1b_interleaved" else R
        pas = {"pipeline_nmicros": args.nmicros, "pipeline_scheduler": sched, "pipeline_nstages": nstages,
               "pipeline_pivots": "Block"}
        cfg = ComputeConfig(R, R, trace_strategy="cpu", use_end2end=True, pas_config=pas)
        t0 = time.perf_counter()
        pm = parallelize(make_model(args), micro_batch(args, 0, 0), "pp", cfg, gen_savedir=args.gen_dir,
                         instance_name=f"pp{R}_{sched}", reuse="override")
        r = runs[sched] = {"pm": pm, "opt": build_optimizer(pm, torch.optim.SGD, lr=1e-4), "ex": pm._executor(),
                           "waits": [], "cpu": {}, "unit": {}, "steps": [], "build_s": time.perf_counter() - t0}
        _instrument(r["ex"], r["waits"], r["cpu"], r["unit"])
    ref, ref_s = make_model(args), []  # the unpipelined model, stepped by rank 0 alone once per round
    for step in range(args.warmup + args.steps + 1):
        tracked = step == args.warmup  # one step counts activations (hooks cost time): not timed
        samples = [micro_batch(args, step, i) for i in range(args.nmicros)]
        dist.barrier()
        if rank == 0:
            t0 = time.perf_counter()
            ref.zero_grad()
            for sample in samples:
                ref(**sample).backward()
            ref_s.append(time.perf_counter() - t0)
        for sched in args.schedules[step % len(args.schedules):] + args.schedules[:step % len(args.schedules)]:
            r, ex = runs[sched], runs[sched]["ex"]
            r["opt"].zero_grad()
            ex.track_activations = tracked
            ex.peak_activation_bytes = ex.live_activation_bytes = 0
            r["waits"].clear()
            dist.barrier()
            sent = ex.mailbox.bytes_sent
            losses = r["pm"].train_step(samples)
            r["opt"].step()
            if tracked:  # sent buffers stay referenced until the schedule proves them delivered
                r["peak"], r["sent"] = ex.peak_activation_bytes, ex.mailbox.bytes_sent - sent
                r["held"] = ex.mailbox.peak_held_bytes
            if step <= args.warmup:
                continue
            tl = [(n, a0, a1, sum(min(a1, w1) - max(a0, w0) for w0, w1 in r["waits"] if w0 < a1 and w1 > a0),
                   r["cpu"][n]) for n, a0, a1 in ex.last_timeline]  # (action, start, end, receive wait, CPU)
            r["steps"].append({"timeline": tl, "loss": float(torch.stack([o.reshape(()) for o in losses]).mean())})
    out = {s: {"build_s": r["build_s"], "steps": r["steps"], "stage_act_bytes": r["unit"],
               "peak_activation_bytes": r["peak"], "sent_bytes_per_step": r["sent"],
               "peak_sent_bytes_held": r["held"]} for s, r in runs.items()}
    return {"runs": out, "unpipelined_s": ref_s[args.warmup + 1:]}


def _replay(sc, cost) -> float:
    """Bubble of the schedule's action lists with per-action costs `cost[str(action)]`, communication
    free (the dependencies of nnscaler.ir.schedules)."""
    lists, done, free, ptr = [sc.actions(d) for d in range(sc.ndevices)], {}, [0.0] * sc.ndevices, [0] * sc.ndevices
    while any(ptr[d] < len(lists[d]) for d in range(sc.ndevices)):
        for d in range(sc.ndevices):
            while ptr[d] < len(lists[d]):
                a = lists[d][ptr[d]]
                deps = sc.deps(a)
                if not all(x in done for x in deps):
                    break
                start = max([free[d]] + [done[x] for x in deps])
                free[d] = done[(a.kind, a.stage, a.micro)] = start + cost[str(a)]
                ptr[d] += 1
    return 1 - sum(cost.values()) / (sc.ndevices * max(free))


def _replay_bytes(sc, d: int, unit: dict) -> int:
    """Peak of the activation bytes device `d` holds over its action list (`unit[stage]` per forward)."""
    cur = peak = 0
    for a in sc.actions(d):
        cur += unit[a.stage] if a.kind == "F" else -unit[a.stage]
        peak = max(peak, cur)
    return peak


def summarize(args, ranks: list, ref_s: float) -> dict:
    from nnscaler.ir.schedules import get_schedule
    R, res = args.ranks, {}
    for sched in args.schedules:
        nstages = 2 * R if sched == "1f1b_interleaved" else R
        sc = get_schedule(sched, nstages, args.nmicros, R)
        per = [r[sched] for r in ranks]
        m = {k: [] for k in ("bubble", "spans", "replay", "wall", "busy", "wait", "cpu")}
        for i in range(args.steps):
            tls = [p["steps"][i]["timeline"] for p in per]
            lo, hi = min(tl[0][1] for tl in tls), max(tl[-1][2] for tl in tls)
            acts = [x for tl in tls for x in tl]
            busy = sum(a1 - a0 - w for _, a0, a1, w, _ in acts)
            m["bubble"].append(1 - busy / (R * (hi - lo)))
            m["spans"].append(1 - sum(a1 - a0 for _, a0, a1, _, _ in acts) / (R * (hi - lo)))
            m["replay"].append(_replay(sc, {n: c for n, _, _, _, c in acts}))
            m["wall"].append(hi - lo)
            m["busy"].append(busy / R)
            m["wait"].append(sum(w for *_, w, _ in acts) / R)
            m["cpu"].append(sum(c for *_, c in acts))
        unit = {int(s): b for p in per for s, b in p["stage_act_bytes"].items()}
        # analytic bytes saved per micro-batch: a block keeps fc's input (d), gelu's input and proj's
        # input (4d each) = 36 mb d bytes in fp32; the last stage's mse_loss keeps input and target
        mb_d = args.micro_batch * args.width
        theory = {s: 36 * mb_d * args.layers // nstages + (8 * mb_d if s == nstages - 1 else 0)
                  for s in range(nstages)}
        act = []
        for d in range(R):
            meas = per[d]["peak_activation_bytes"]
            th, pred = _replay_bytes(sc, d, theory), _replay_bytes(sc, d, unit)
            act.append({"rank": d, "stages": sorted({a.stage for a in sc.actions(d)}),
                        "peak_inflight": peak_inflight(sc, d), "measured_bytes": meas, "theory_bytes": th,
                        "measured_over_theory": meas / th, "from_measured_stage_bytes": pred,
                        "sent_bytes_per_step": per[d]["sent_bytes_per_step"],
                        "peak_sent_bytes_held": per[d]["peak_sent_bytes_held"]})
        med, ana, sim = _common.median(m["bubble"]), sc.analytic_bubble(), bubble_fraction(sc)
        res[sched] = {
            "nstages": nstages, "pp_size": R, "nmicros": args.nmicros,
            "bubble_measured_median": med, "bubble_measured_steps": m["bubble"],
            "bubble_analytic": ana, "bubble_simulated": sim,
            "measured_over_analytic": med / ana if ana else None, "measured_over_simulated": med / sim,
            "bubble_spans_median": _common.median(m["spans"]),
            "bubble_replay_cpu_costs_median": _common.median(m["replay"]),
            "step_wall_ms_median": 1e3 * _common.median(m["wall"]),
            "busy_ms_per_rank_median": 1e3 * _common.median(m["busy"]),
            "recv_wait_ms_per_rank_median": 1e3 * _common.median(m["wait"]),
            "cpu_ms_all_ranks_median": 1e3 * _common.median(m["cpu"]),
            "on_cpu_fraction_of_busy": _common.median(c / (R * b) for c, b in zip(m["cpu"], m["busy"])),
            "cpu_over_unpipelined": _common.median(m["cpu"]) / ref_s,
            "speedup_over_unpipelined": ref_s / _common.median(m["wall"]),
            "build_s": max(p["build_s"] for p in per), "stage_act_bytes_per_micro": unit,
            "activations": act, "losses": [s["loss"] for s in per[0]["steps"]],
        }
    if "gpipe" in res:
        for r in res.values():
            for a, g in zip(r["activations"], res["gpipe"]["activations"]):
                a["over_gpipe"] = a["measured_bytes"] / g["measured_bytes"]
    return res


def _f(x, fmt="{:.3f}"):
    return "-" if x is None else fmt.format(x)


def report(args, res: dict, ref_s: float) -> None:
    R, cores = args.ranks, _common.cpu_count()
    print(f"\n{R} ranks x {args.threads} thread(s) on {cores} cores, m={args.nmicros}, {args.layers} blocks of "
          f"width {args.width}, micro-batch {args.micro_batch}; medians of {args.steps} timed steps; unpipelined "
          f"step (rank 0 alone, {args.threads} thread(s)) {1e3 * ref_s:.0f} ms")
    if R > cores:
        print(f"NOTE: {R} processes on {cores} cores oversubscribe the CPU: concurrent stages slow each other and "
              f"a rank woken by a message may wait for a core, so wall-clock bubbles are noisy (try --ranks 2)")
    rows = [[s, f"{r['nstages']}/{r['pp_size']}", f"{r['bubble_measured_median']:.3f}", _f(r["bubble_analytic"]),
             f"{r['bubble_simulated']:.3f}", _f(r["measured_over_analytic"], "{:.2f}"),
             f"{r['measured_over_simulated']:.2f}", f"{r['bubble_spans_median']:.3f}",
             f"{r['bubble_replay_cpu_costs_median']:.3f}", f"{r['step_wall_ms_median']:.0f}",
             f"{r['busy_ms_per_rank_median']:.0f}", f"{r['recv_wait_ms_per_rank_median']:.0f}",
             f"{r['on_cpu_fraction_of_busy']:.2f}", f"{r['speedup_over_unpipelined']:.2f}"] for s, r in res.items()]
    print(_common.table(["schedule", "stages/devs", "bubble", "analytic", "simulated", "/analytic", "/sim",
                         "spans only", "replay cpu", "step ms", "busy ms", "wait ms", "on-cpu", "speed-up"], rows))
    losses = [r["losses"] for r in res.values()]
    print(f"losses over the timed steps agree across schedules: max |diff| "
          f"{max(abs(a - b) for l in losses for a, b in zip(l, losses[0])):.2e} (same data, same initial weights)")
    print("\npeak activation bytes per rank (saved for backward, one step; theory = the rank's action list "
          "replayed with 36 mb d bytes per block per micro-batch, + 8 mb d for the loss)")
    rows = [[s, a["rank"], ",".join(map(str, a["stages"])), a["peak_inflight"], _common.fmt_bytes(a["measured_bytes"]),
             _common.fmt_bytes(a["theory_bytes"]), _f(a["measured_over_theory"]), _f(a.get("over_gpipe")),
             _common.fmt_bytes(a["sent_bytes_per_step"]), _common.fmt_bytes(a["peak_sent_bytes_held"])]
            for s, r in res.items() for a in r["activations"]]
    print(_common.table(["schedule", "rank", "stages", "peak in-flight", "measured B", "theory B",
                         "meas/theory", "/ gpipe", "sent B", "sends held B"], rows))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=4, choices=(2, 4), help="plan = runtime devices = pipeline devices")
    ap.add_argument("--schedules", nargs="*", default=None, help="default: all that fit --ranks")
    ap.add_argument("--nmicros", type=int, default=8)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--micro-batch", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=8, help="timed steps (after the warm-up and the activation step)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = _common.parse_args(ap, {"ranks": 2, "layers": 4, "width": 32, "micro_batch": 4, "steps": 1, "warmup": 1,
                                   "nmicros": 4}, "pipeline_r2.json")
    args.schedules = list(dict.fromkeys(args.schedules or SCHEDULES[args.ranks]))
    args.threads = args.threads or _common.threads_per_rank(args.ranks)
    name = "pipeline.json" if args.ranks == 4 else f"pipeline_r{args.ranks}.json"
    out = args.out or str(_common.RESULTS_DIR / name)
    load0 = _common.loadavg()
    with tempfile.TemporaryDirectory() as tmp:
        args.gen_dir = tmp
        ranks, spawn_s = _common.spawn_gloo(_worker, (args,), args.ranks, os.path.join(tmp, "result.json"),
                                            threads=args.threads)
    ref_s = _common.median(ranks[0]["unpipelined_s"])
    ranks = [r["runs"] for r in ranks]
    res = summarize(args, ranks, ref_s)
    report(args, res, ref_s)
    data = {**_common.run_header(), "config": {k: v for k, v in vars(args).items() if k != "gen_dir"},
            "loadavg_before": load0, "loadavg_after": _common.loadavg(), "spawn_s": spawn_s,
            "oversubscribed": args.ranks > _common.cpu_count(), "unpipelined_step_ms": 1e3 * ref_s, "schedules": res,
            "last_step_timelines": {s: [r[s]["steps"][-1]["timeline"] for r in ranks] for s in args.schedules}}
    _common.save_results(out, data)
    print(f"{spawn_s:.0f} s in the workers")


if __name__ == "__main__":
    main()
