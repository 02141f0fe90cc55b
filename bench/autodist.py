"""autodist's plans against every built-in policy that fits, on real gloo processes; its
estimates against measurements; the no-plan-fits error; search time against depth.

    python bench/autodist.py                       # GPT + Llama-style, 2 and 4 ranks -> autodist.json
    python bench/autodist.py --models gpt --ranks 2 --depths 4 8   # a smaller run

One run, on this machine:

0. **Comm profile.** ``NNSCALER_CACHE_DIR`` points at a fresh directory (``--cache-dir`` to keep
   one), so autodist measures the gloo collectives once (``measured_comm_model``, timed) and
   profiles the ops once; every later search (in this process and in rank 0 of the workers)
   reads the cache. The op-profile key holds the thread count: this process uses the workers'
   ``cores // ranks`` threads so that both share it.
1. **Plan quality.** For each model (``gpt``: examples/gpt.py; ``llama``: Hugging Face Llama with
   RMSNorm, rotary, GQA and SwiGLU, the `tests/models/hf_models.py` wrapper that returns the loss)
   and each rank count R, every plan trains fp32 with Adam through ``use_end2end=True``: a step is
   ``opt.zero_grad(); pm.train_step(M micro-batches); opt.step()`` on the same global batch
   (``--micro-batch`` sequences per micro-batch, split over the data-parallel units). Plans:
   ``dp`` (plan_ngpus 1), ``zero`` (dp + use_zero), ``tp``, ``megatron``, ``data`` (plan_ngpus R),
   ``pp`` (R stages at pivots), and at R = 4 ``hybrid`` (pp 2 x tp 2), ``megatron-tp2-dp2`` and
   ``pp2-dp2``. Limits: (a) none, (b) 70 % of autodist's own estimate of the dp plan (excludes
   dp; 80 / 90 % where autodist finds nothing under 70 %), (c) one that needs a pipeline: a
   separate case (`pipeline_case`) where the user forbids splitting any op (a constraints file)
   on a model whose weights outweigh its activations (``--pipe-embd``, ``--pipe-seq``, one
   sequence per rank per micro-batch, ``--pipe-nmicros``), the limit 90 % of the least memory
   autodist finds without a pipeline (dp or dp + ZeRO), pipelines searched at the block class,
   against dp, zero, pp R and (R = 4) pp2-dp2. **autodist's plan** for a limit: autodist searched at plan_ngpus 1, 2 and R
   (data-parallel degree R / plan_ngpus) under the limit, with ``pipeline_pivots`` at the block
   class (so every stage count of each unit is searched too), the one with the lowest *estimated*
   step time (the choice uses estimates only; plan_ngpus 1 is plain dp). The searches run here
   first (same cache, so rank 0 of the workers finds the same plan; the bench checks it).
   All plans then run in the same R processes (``cores // R`` threads each): ``--warmup`` steps,
   ``--rounds`` timed rounds of one step per plan, each after ``--settle`` untimed steps of the
   same plan (a training job runs one plan back to back; right after another plan's step, caches
   and the allocator hold that plan's tensors) (order rotated, barrier first, a step's time is
   the slower rank's), median. After 2 rounds, plans over 2x the slowest of autodist's picks are
   timed no more (``rounds_timed``): they cannot decide a ratio (autodist's pick would be under half
   of them), and the time saved buys more rounds of the others (the runs of identical plans
   differed by up to 8 % with 9 rounds). Peak memory per rank: the process's RSS high-water mark over one
   step (``/proc/self/clear_refs`` 5, then VmHWM - VmRSS before the step) plus the bytes of the
   distinct storages already held before it (parameters, gradients, optimizer state), measured in a
   second set of R processes (the generated code reused; one warm-up step first) started with
   ``MALLOC_MMAP_THRESHOLD_`` = 64 KiB, so that freed tensors go back to the OS and new ones show
   in RSS. Not in the timed processes: the page faults of mapping every large tensor afresh
   nearly double a step's CPU time (22 -> 39 ms for the GPT's forward + backward here); and
   ``mallopt`` after the timed steps does not work (freed heap is reused, RSS misses it). "Fits" = this measured peak (max over ranks) <= the limit.
   Reported: autodist's measured step against the best that fits (target <= 1.05); its
   estimated step time and memory against the measured ones (target within 20 %), with the
   estimate split into compute (profiled ops) and communication, and the measured step split into
   train_step and the optimizer step (not in the cost model).
2. **No plan fits.** A limit of half the least memory found: the error message (it must name the
   smallest memory found).
3. **Search time against depth.** GPT with ``--depths`` layers (small width: the search depends on
   the op count), ``nnscaler.ir.trace`` + ``apply_policy(graph, ComputeConfig(4, 4), "autodist")``
   in this process, the second run of each depth (profile cached): trace seconds and
   ``estimate['search_s']``. Target: near-linear, <= 2 s at 32 layers.

Writes bench/results/autodist.json (``--out``).
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import os
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

_common.add_examples_to_path()
MODELS_DIR = str(_common.REPO_ROOT / "tests" / "models")
if MODELS_DIR not in sys.path:
    sys.path.insert(0, MODELS_DIR)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

TARGET_RATIO = 1.05
TARGET_ESTIMATE = 0.20
TARGET_SEARCH_32 = 2.0
ZERO_MARGIN = 0.05
PRUNE_AFTER, PRUNE_FACTOR = 2, 2.0  # after 2 rounds, plans over 2x the slowest of autodist's picks are timed no more
PIVOT = {"gpt": "Block", "llama": "LlamaDecoderLayer"}


# -- models -----------------------------------------------------------------------------------------

def model_config(args, name: str) -> dict:
    return {"name": name, "layers": args.layers, "embd": args.embd, "heads": args.heads, "seq": args.seq,
            "vocab": args.vocab, "kv_heads": max(1, args.heads // 2), "ffn": args.ffn or 4 * args.embd}


def build_model(mc: dict) -> torch.nn.Module:
    torch.manual_seed(0)
    if mc["name"] == "gpt":
        from gpt import GPT, GPTConfig
        return GPT(GPTConfig(vocab_size=mc["vocab"], block_size=mc["seq"], n_layer=mc["layers"], n_head=mc["heads"],
                             n_embd=mc["embd"], use_sdpa=False))
    import hf_models
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=mc["vocab"], hidden_size=mc["embd"], intermediate_size=mc["ffn"],
                      num_hidden_layers=mc["layers"], num_attention_heads=mc["heads"],
                      num_key_value_heads=mc["kv_heads"], max_position_embeddings=mc["seq"], attention_dropout=0.0,
                      attn_implementation="sdpa", use_cache=False)
    return hf_models._same_dtype_rms_norm(hf_models.CausalLM(LlamaForCausalLM(cfg))).train()


def make_batch(mc: dict, step: int, n: int) -> dict:
    g = torch.Generator().manual_seed(1000 + step)
    seq = torch.randint(0, mc["vocab"], (n, mc["seq"] + 1), generator=g)
    ids, labels = seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
    return {"idx": ids, "targets": labels} if mc["name"] == "gpt" else {"input_ids": ids, "labels": labels}


# -- plans ------------------------------------------------------------------------------------------

def baseline_plans(name: str, R: int, M: int) -> list:
    """The built-in policies and hand plans: (label, policy, plan_ngpus, pas_config, use_zero)."""
    piv = PIVOT[name]
    plans = [("dp", "dp", 1, {}, False), ("zero", "dp", 1, {}, True), ("tp", "tp", R, {}, False),
             ("megatron", "megatron", R, {}, False), ("data", "data", R, {}, False),
             (f"pp{R}", "pp", R, {"pipeline_pivots": piv, "pipeline_nmicros": M}, False)]
    if R == 4:
        plans += [("hybrid-pp2-tp2", "hybrid", 4, {"pipeline_pivots": piv, "pipeline_nmicros": M,
                                                   "pipeline_nstages": 2, "pp_size": 2}, False),
                  ("megatron-tp2-dp2", "megatron", 2, {}, False),
                  ("pp2-dp2", "pp", 2, {"pipeline_pivots": piv, "pipeline_nmicros": M}, False)]
    return [dict(label=l, policy=p, plan=n, pas=pas, zero=z) for l, p, n, pas, z in plans]


def divisors(R: int) -> list:
    """The plan_ngpus autodist is searched at: 1 (plain dp), 2 and R."""
    return sorted(p for p in {1, 2, R} if p <= R and R % p == 0)


def trace_graph(mc: dict, plan: int, R: int, micro: int):
    from nnscaler.ir import trace
    per_unit = micro // (R // plan)
    return trace(build_model(mc), make_batch(mc, 0, per_unit), constant_folding=False, trace_strategy="cpu")


def autodist_pas(M: int, limit_gb=None, pivot=None, constraints=None) -> dict:
    pas = {"update_freq": M}
    if constraints:
        pas["partition_constraints_path"] = constraints
    if limit_gb is not None:
        pas["mem_constraint"] = limit_gb
    if pivot:
        pas["pipeline_pivots"] = pivot
    return pas


def search_here(mc, plan, R, micro, pas, zero=False):
    """autodist's search in this process: (record, problem, solution pick) or the error text."""
    from nnscaler.ir import ComputeConfig
    from nnscaler.policies.autodist.config import AutodistConfig
    from nnscaler.policies.autodist.policy import search
    from nnscaler.policies.autodist.spmd_solver import NoPlanFits
    graph = trace_graph(mc, plan, R, micro)
    cfg = AutodistConfig.from_compute_config(ComputeConfig(plan, R, use_end2end=True, use_zero=zero, pas_config=pas))
    try:
        record, labels, cut = search(graph, cfg)
    except NoPlanFits as e:
        return None, str(e)
    return record, _breakdown(graph, cfg, record, cut)


def _breakdown(graph, cfg, record, cut) -> dict:
    """The estimate's compute (profiled ops) and communication parts, per step."""
    from nnscaler.policies.autodist.comm_profile import measured_comm_model
    from nnscaler.policies.autodist.policy import _Search
    if cut is not None:
        return {"pipeline": True, "stage_time_s": cut.stage_time, "stage_mem_bytes": cut.stage_mem}
    s = _Search(graph, cfg)
    comm = measured_comm_model({cfg.plan_ngpus, cfg.dp_size, cfg.runtime_ngpus}, s.device, world=s.procs, load=s.scale)
    problem = s.problem(cfg.plan_ngpus, comm)
    labels = {node.id: op.choice for node, op in zip(graph.nodes, record.ops)}
    pick = [op.labels.index(labels[op.node.id]) for op in problem.ops]
    t, m = problem.evaluate(pick)
    compute = sum(op.compute[c] for op, c in zip(problem.ops, pick)) * cfg.nmicros
    return {"pipeline": False, "compute_s": compute, "comm_s": t * cfg.nmicros - compute,
            "check_time_s": t * cfg.nmicros}


def plan_signature(record) -> str:
    return json.dumps([record.plan_ngpus, [(o.key, o.choice, o.stage) for o in record.ops], record.pipeline])


# -- workers ------------------------------------------------------------------------------------------

def _status(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _held_bytes(pm, opt) -> int:
    seen, total = set(), 0
    tensors = list(pm.parameters()) + [p.grad for p in pm.parameters() if p.grad is not None] + list(pm.buffers())
    for state in opt.state.values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    for t in tensors:
        st = t.untyped_storage()
        if st.data_ptr() in seen:
            continue
        seen.add(st.data_ptr())
        total += st.nbytes()
    return total


def _step(pm, opt, mbs, phases=None, cpu=None):
    c0 = time.process_time()
    t0 = time.perf_counter()
    opt.zero_grad()
    pm.train_step(mbs)
    t1 = time.perf_counter()
    opt.step()
    if phases is not None:
        phases[0] += t1 - t0
        phases[1] += time.perf_counter() - t1
    if cpu is not None:
        cpu.append(time.process_time() - c0)
    return time.perf_counter() - t0


def _run(rank: int, mc: dict, R: int, variants: list, args_d: dict, gen_dir: str) -> dict:
    from nnscaler import ComputeConfig, build_optimizer, parallelize
    M, micro = args_d["nmicros"], args_d["micro_batch"]
    built, info = {}, {}
    base = build_model(mc)
    for v in variants:
        label = v["label"]
        plan = v["plan"]
        d = R // plan
        unit = rank // plan
        per_unit = micro // d
        mbs = []
        for s in range(M):
            full = make_batch(mc, s, micro)
            mbs.append({k: t[unit * per_unit:(unit + 1) * per_unit].contiguous() for k, t in full.items()})
        pas = dict(v["pas"])
        plan_path = os.path.join(gen_dir, f"{label}.plan.json")
        if v["policy"] == "autodist":
            pas["save_plan_path"] = plan_path
        cc = ComputeConfig(plan, R, use_end2end=True, use_zero=v["zero"], trace_strategy="cpu", pas_config=pas)
        t0 = time.perf_counter()
        try:
            pm = parallelize(copy.deepcopy(base), mbs[0], v["policy"], cc, gen_savedir=gen_dir,
                             instance_name=label.replace("/", "_"),
                             reuse="override" if args_d["phase"] == "time" else "match")
            opt = build_optimizer(pm, torch.optim.Adam, lr=1e-4)
        except Exception as e:  # noqa: BLE001 - parallelize shares its error with every rank
            info[label] = {"error": f"{type(e).__name__}: {e}"[:500]}
            continue
        info[label] = {"parallelize_s": time.perf_counter() - t0}
        if v["policy"] == "autodist" and args_d["phase"] == "time":
            dist.barrier()
            with open(plan_path) as f:
                info[label]["plan_estimate"] = json.load(f).get("estimate")
        built[label] = (pm, opt, mbs)
    names = list(built)
    for _ in range(args_d["warmup"]):
        for n in names:
            dist.barrier()
            _step(*built[n])
    times = {n: [] for n in names}
    cpu = {n: [] for n in names}
    phases = {n: [0.0, 0.0] for n in names}
    active = list(names)
    for r in range(args_d["rounds"] if args_d["phase"] == "time" else 0):
        order = active[r % len(active):] + active[:r % len(active)] if active else []
        for n in order:
            for _ in range(args_d.get("settle", 1)):  # untimed: the plan's caches warm again after the others
                dist.barrier()
                _step(*built[n])
            dist.barrier()
            times[n].append(_step(*built[n], phases[n], cpu[n]))
        if r + 1 == PRUNE_AFTER and active:
            active = _contenders(active, times)
    mem = {}
    for n in (names if args_d["phase"] == "mem" else []):
        pm, opt, mbs = built[n]
        gc.collect()
        opt.zero_grad()
        dist.barrier()
        held = _held_bytes(pm, opt)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = _status("VmRSS")
        _step(pm, opt, mbs)
        growth = _status("VmHWM") - before
        mem[n] = {"held_before_bytes": held, "rss_growth_bytes": growth, "peak_bytes": held + growth}
    dist.barrier()
    return {"rank": rank, "info": info, "times": times, "cpu": cpu, "phases": phases, "mem": mem,
            "loadavg": _common.loadavg()}


def _contenders(names: list, times: dict) -> list:
    """The plans still timed after PRUNE_AFTER rounds: autodist's, and those within PRUNE_FACTOR of
    the slowest of autodist's (by the slowest rank's median, the same list on every rank). A plan
    beyond that cannot decide a ratio (autodist's pick over the best that fits it would be under
    1 / PRUNE_FACTOR whatever the noise); its rounds so far are its measurement, and the rounds
    saved time the contenders more often."""
    med = torch.tensor([_common.median(times[n]) for n in names], dtype=torch.float64)
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    ours = [m for n, m in zip(names, med.tolist()) if n.startswith("autodist")]
    if not ours:
        return names
    return [n for n, m in zip(names, med.tolist()) if n.startswith("autodist") or m <= PRUNE_FACTOR * max(ours)]


# -- main ---------------------------------------------------------------------------------------------

def plan_quality(args, name: str, R: int, comm_cache_ok: bool) -> dict:
    mc = model_config(args, name)
    M, micro = args.nmicros, args.micro_batch
    torch.set_num_threads(_common.threads_per_rank(R))
    out = {"model": mc, "ranks": R, "nmicros": M, "micro_batch": micro, "threads_per_rank": _common.threads_per_rank(R)}
    n_params = sum(p.numel() for p in build_model(mc).parameters())
    out["params"] = n_params
    GB = 1024 ** 3
    # autodist's estimates here (same cache as the workers)
    t0 = time.perf_counter()
    dp_rec, dp_parts = search_here(mc, 1, R, micro, autodist_pas(M))
    dp_est = dp_rec.estimate
    per_process = dp_parts["compute_s"] / dp_est.get("compute_scale", 1.0)
    out["compute_model_check"] = compute_check(mc, micro // R, M, per_process / dp_est.get("compute_calibration", 1.0),
                                               per_process)
    limits = {"none": None}
    # the least memory of any SPMD plan (autodist's cost model): the no-plan error names it
    least = {}
    for p in divisors(R):
        rec, err = search_here(mc, p, R, micro, autodist_pas(M, 1e-6))
        least[p] = err
    out["no_plan_errors_spmd"] = {str(p): e for p, e in least.items()}
    least_bytes = min(_parse_needs(e) for e in least.values())
    out["least_spmd_mem_bytes"] = least_bytes
    searches = {}
    # (b): 70 % of dp's estimate; where autodist finds nothing that small, 80 / 90 % (recorded)
    fractions = [0.7, 0.8, 0.9]
    for frac in fractions:
        limits["no_dp"] = frac * dp_est["mem_bytes"] / GB
        if _candidates(mc, R, micro, M, limits["no_dp"], PIVOT[name])[1] is not None:
            break
    out["no_dp_fraction_of_dp_estimate"] = frac
    for lim_name, lim in limits.items():
        cands, pick = _candidates(mc, R, micro, M, lim, PIVOT[name])
        searches[lim_name] = {"limit_gb": lim, "candidates": cands, "pick": pick}
    # the pipeline's own least memory (for the record): pipeline_nstages R, no limit
    rec, _ = search_here(mc, R, R, micro, dict(autodist_pas(M, None, PIVOT[name]), pipeline_nstages=R))
    out["pipeline_nstages_R_estimate"] = rec.estimate if rec is not None else None
    out["planning_s"] = time.perf_counter() - t0
    # nothing fits: half the least memory, pivots given (pipelines searched too)
    rec, err = search_here(mc, R, R, micro, autodist_pas(M, 0.5 * least_bytes / GB, PIVOT[name]))
    out["nothing_fits"] = {"limit_gb": 0.5 * least_bytes / GB, "error": err if rec is None else None,
                           "unexpected_plan": rec.estimate if rec is not None else None}
    # the variants to run
    variants = baseline_plans(name, R, M)
    _add_picks(variants, searches)
    runs, meta = _measure(args, mc, R, variants, M, micro)
    out.update(meta)
    out["runs"] = runs
    # per limit: autodist against the best that fits
    out["limits"] = {lim_name: _limit_entry(srch, runs) for lim_name, srch in searches.items()}
    out["dp_estimate"] = dp_est
    return out


def _add_picks(variants: list, searches: dict) -> None:
    """autodist's pick of each limit as a variant to run (one run per distinct plan)."""
    seen = {}
    for lim_name, s in searches.items():
        pick = s["pick"]
        if pick is None or s.get("skipped"):
            continue
        sig = pick["signature"]
        if sig not in seen:
            label = f"autodist[{lim_name}]-p{pick['plan_ngpus']}" + ("-zero" if pick["use_zero"] else "")
            seen[sig] = label
            variants.append(dict(label=label, policy="autodist", plan=pick["plan_ngpus"], pas=pick["pas"],
                                 zero=pick["use_zero"]))
        s["label"] = seen[sig]


def pipeline_case(args, name: str, R: int) -> dict:
    """(c) A limit that needs a pipeline. The user forbids splitting any op (constraints file:
    every op ``replicate: true``, e.g. no tensor parallelism over a slow link), on a model whose
    weights outweigh its activations (`--pipe-embd`, `--pipe-seq`, one sequence per rank per
    micro-batch, `--pipe-nmicros`). Limit: 90 % of the least memory autodist finds without a
    pipeline under that constraint (dp, dp + ZeRO, any plan_ngpus); pipelines searched at the
    block class. autodist's pick runs against the plans that obey the constraint (dp, zero,
    pp R, at R = 4 pp2-dp2), and the best of those that fit."""
    mc = dict(model_config(args, name), embd=args.pipe_embd, seq=args.pipe_seq, ffn=4 * args.pipe_embd)
    M, micro = args.pipe_nmicros, R
    torch.set_num_threads(_common.threads_per_rank(R))
    GB = 1024 ** 3
    out = {"model": mc, "ranks": R, "nmicros": M, "micro_batch": micro,
           "params": sum(p.numel() for p in build_model(mc).parameters())}
    with tempfile.TemporaryDirectory() as tmp:
        constraints = os.path.join(tmp, "no_op_split.yaml")
        with open(constraints, "w") as f:
            f.write('- op: "*"\n  replicate: true\n')
        out["constraints"] = [{"op": "*", "replicate": True}]
        least = []
        for p in divisors(R):
            for zero in ([False, True] if R // p > 1 else [False]):
                rec, err = search_here(mc, p, R, micro, autodist_pas(M, 1e-6, None, constraints), zero)
                least.append(_parse_needs(err))
        out["least_spmd_mem_bytes"] = min(least)
        lim = 0.9 * min(least) / GB
        cands, pick = _candidates(mc, R, micro, M, lim, PIVOT[name], constraints)
        searches = {"pipeline": {"limit_gb": lim, "candidates": cands, "pick": pick}}
        if pick is None or not pick["pipeline"]:
            searches["pipeline"]["skipped"] = "autodist found no plan" if pick is None else "the pick is not a pipeline"
        variants = [v for v in baseline_plans(name, R, M) if v["label"] in ("dp", "zero", f"pp{R}", "pp2-dp2")]
        _add_picks(variants, searches)
        runs, meta = _measure(args, mc, R, variants, M, micro)
    out.update(meta)
    out["runs"] = runs
    out["limits"] = {"pipeline": _limit_entry(searches["pipeline"], runs,
                                              admissible={v["label"] for v in variants})}
    return out


def _measure(args, mc: dict, R: int, variants: list, M: int, micro: int):
    """Every variant timed in R processes, then its peak memory in R fresh ones: (runs, meta)."""
    with tempfile.TemporaryDirectory() as tmp:
        args_d = {"nmicros": M, "micro_batch": micro, "warmup": args.warmup, "rounds": args.rounds, "phase": "time",
                  "settle": args.settle}
        res, spawn_s = _common.spawn_gloo(_run, (mc, R, variants, args_d, os.path.join(tmp, "gen")), R,
                                          os.path.join(tmp, "r.json"))
        # memory in fresh processes (the generated code reused) where glibc maps every large
        # allocation on its own: RSS then shows a step's tensors; it would slow the timed steps
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # read by glibc at start: the workers inherit it
        try:
            res_mem, mem_s = _common.spawn_gloo(_run, (mc, R, variants, dict(args_d, phase="mem", warmup=1),
                                                       os.path.join(tmp, "gen")), R, os.path.join(tmp, "m.json"))
        finally:
            os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
        for r, m in zip(res, res_mem):
            r["mem"] = m["mem"]
    runs = {}
    for v in variants:
        lab = v["label"]
        errs = [r["info"].get(lab, {}).get("error") for r in res]
        if any(errs):
            runs[lab] = {"policy": v["policy"], "plan_ngpus": v["plan"], "error": next(e for e in errs if e)}
            continue
        rounds = len(res[0]["times"][lab])
        per_round = [max(r["times"][lab][i] for r in res) for i in range(rounds)]
        cpu_round = [max(r["cpu"][lab][i] for r in res) for i in range(rounds)]
        ph = [sum(r["phases"][lab][k] for r in res) / R / rounds for k in (0, 1)]
        peaks = [r["mem"][lab]["peak_bytes"] for r in res]
        runs[lab] = {"policy": v["policy"], "plan_ngpus": v["plan"], "use_zero": v["zero"],
                     "pas_config": v["pas"], "step_s_median": _common.median(per_round), "step_s_rounds": per_round,
                     "rounds_timed": rounds,
                     "cpu_s_median": _common.median(cpu_round),
                     "on_cpu_share": sum(sum(r["cpu"][lab]) for r in res) / sum(sum(r["times"][lab]) for r in res),
                     "train_step_s_mean": ph[0], "optimizer_s_mean": ph[1], "peak_bytes_max": max(peaks),
                     "peak_bytes_per_rank": peaks, "mem_per_rank": [r["mem"][lab] for r in res],
                     "parallelize_s": res[0]["info"][lab].get("parallelize_s")}
        if v["policy"] == "autodist":
            runs[lab]["worker_estimate"] = res[0]["info"][lab].get("plan_estimate")
    return runs, {"spawn_s": spawn_s, "spawn_mem_s": mem_s, "loadavg_workers_end": res[0].get("loadavg")}


def _limit_entry(s: dict, runs: dict, admissible=None) -> dict:
    """autodist's pick under one limit against the measured runs that fit it (`admissible`: the
    baselines allowed to compete, default all)."""
    GB = 1024 ** 3
    lim = s["limit_gb"]
    entry = {"limit_gb": lim, "limit_bytes": None if lim is None else lim * GB}
    if s.get("skipped") or s["pick"] is None:
        entry["skipped"] = s.get("skipped") or "autodist found no plan"
        entry["candidates"] = s["candidates"]
        return entry
    lab = s["label"]
    run = runs.get(lab, {})
    fits = {k: r["step_s_median"] for k, r in runs.items()
            if "step_s_median" in r and r["policy"] != "autodist" and (admissible is None or k in admissible)
            and (lim is None or r["peak_bytes_max"] <= lim * GB)}
    best = min(fits, key=fits.get) if fits else None
    fits_min = {k: min(runs[k]["step_s_rounds"]) for k in fits}
    best_min = min(fits_min, key=fits_min.get) if fits_min else None
    est = s["pick"]["estimate"]
    entry.update({
        "autodist_label": lab, "autodist_plan_ngpus": s["pick"]["plan_ngpus"],
        "autodist_use_zero": s["pick"]["use_zero"], "autodist_pipeline": s["pick"]["pipeline"],
        "autodist_measured_step_s": run.get("step_s_median"), "autodist_measured_peak_bytes": run.get("peak_bytes_max"),
        "autodist_fits_measured": lim is None or run.get("peak_bytes_max", math.inf) <= lim * GB,
        "fitting_baselines": sorted(fits), "best_baseline": best,
        "best_baseline_step_s": fits.get(best),
        "ratio_autodist_over_best": (run["step_s_median"] / fits[best]) if best and "step_s_median" in run else None,
        "only_autodist_fits": not fits and "step_s_median" in run and (lim is None or run["peak_bytes_max"] <= lim * GB),
        "best_baseline_by_min": best_min,
        "ratio_min_over_min": (min(run["step_s_rounds"]) / fits_min[best_min]) if best_min and "step_s_rounds" in run
        else None,
        "baseline_peak_bytes": {k: r.get("peak_bytes_max") for k, r in runs.items() if r["policy"] != "autodist"},
        "estimated_step_s": est["time_s"], "estimated_mem_bytes": est["mem_bytes"],
        "estimated_over_measured_step": est["time_s"] / run["step_s_median"] if "step_s_median" in run else None,
        "measured_cpu_s": run.get("cpu_s_median"), "on_cpu_share": run.get("on_cpu_share"),
        "estimated_over_measured_cpu": est["time_s"] / est.get("compute_scale", 1.0) / run["cpu_s_median"]
        if run.get("cpu_s_median") else None,
        "estimated_over_measured_mem": est["mem_bytes"] / run["peak_bytes_max"] if "peak_bytes_max" in run else None,
        "estimate_breakdown": s["pick"]["breakdown"],
        "measured_train_step_s": run.get("train_step_s_mean"), "measured_optimizer_s": run.get("optimizer_s_mean"),
        "worker_found_same_estimate": (run.get("worker_estimate") or {}).get("time_s") == est["time_s"],
        "candidates": s["candidates"]})
    return entry


def compute_check(mc: dict, per_rank: int, M: int, profiled_s: float, calibrated_s: float, steps: int = 8) -> dict:
    """The compute part of the cost model against the model run eagerly in this process (same
    threads, no other rank running): M forward + backward of the dp rank's micro-batch. The ops'
    profiled sum, and that sum calibrated by autodist's whole-graph run (graph_timing.py)."""
    model = build_model(mc)
    mbs = [make_batch(mc, s, per_rank) for s in range(M)]
    times = []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        for b in mbs:
            model(**b).backward()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    eager = _common.median(times)
    return {"profiled_ops_sum_s": profiled_s, "calibrated_s": calibrated_s, "eager_fwd_bwd_median_s": eager,
            "eager_fwd_bwd_min_s": min(times), "profiled_over_eager": profiled_s / eager,
            "calibrated_over_eager": calibrated_s / eager, "loadavg": _common.loadavg()}


def _candidates(mc, R, micro, M, lim, pivot, constraints=None):
    """autodist at plan_ngpus 1, 2, R (with and without ZeRO where dp > 1) under `lim` GB:
    every search, and the one of least estimated step time (None when none fits)."""
    cands = []
    for p in divisors(R):
        for zero in ([False, True] if R // p > 1 else [False]):
            pas = autodist_pas(M, lim, pivot, constraints)
            rec, extra = search_here(mc, p, R, micro, pas, zero)
            if rec is None:
                cands.append({"plan_ngpus": p, "use_zero": zero, "error": extra})
            else:
                cands.append({"plan_ngpus": p, "use_zero": zero, "estimate": rec.estimate, "pipeline": rec.pipeline,
                              "method": rec.method, "breakdown": extra,
                              "signature": plan_signature(rec) + str(zero), "pas": pas})
    ok = [c for c in cands if "estimate" in c]
    if not ok:
        return cands, None
    best = min(ok, key=lambda c: c["estimate"]["time_s"])
    plain = [c for c in ok if not c["use_zero"]]
    if best["use_zero"] and plain:
        # ZeRO is a memory option (the user's use_zero): taken when no plan without it fits, or
        # when its estimate is clearly (ZERO_MARGIN) lower. Its measured step here costs 3-8 ms
        # more than the model prices (the runtime's copies per parameter piece, the gather after
        # the optimizer step), so an estimated tie is a measured loss.
        fastest_plain = min(plain, key=lambda c: c["estimate"]["time_s"])
        if best["estimate"]["time_s"] > (1 - ZERO_MARGIN) * fastest_plain["estimate"]["time_s"]:
            best = fastest_plain
    return cands, best


def _parse_needs(msg: str) -> float:
    """The bytes in 'needs X GB' of a NoPlanFits message (the smallest memory found)."""
    import re
    m = re.search(r"needs ([0-9.]+) GB", msg or "")
    return float(m.group(1)) * 1024 ** 3 if m else math.inf


def search_depth(args) -> dict:
    from nnscaler.ir import ComputeConfig, trace
    from nnscaler.policies import apply_policy
    from gpt import GPT, GPTConfig, random_batch
    torch.set_num_threads(1)
    rows = []
    for layers in args.depths:
        cfg = GPTConfig(vocab_size=256, block_size=32, n_layer=layers, n_head=4, n_embd=64, use_sdpa=False)
        torch.manual_seed(0)
        model = GPT(cfg)
        b = random_batch(0, 2, cfg)
        row = {"layers": layers}
        for attempt in ["first"] + [f"again{i}" for i in range(args.search_repeats)]:
            gc.collect()
            t0 = time.perf_counter()
            graph = trace(model, b, constant_folding=False, trace_strategy="cpu")
            t1 = time.perf_counter()
            graph = apply_policy(graph, ComputeConfig(args.depth_ngpus, args.depth_ngpus, pas_config={}), "autodist")
            t2 = time.perf_counter()
            est = graph.autodist_plan.estimate
            row[attempt] = {"trace_s": t1 - t0, "policy_s": t2 - t1, "search_s": est["search_s"],
                            "solver_s": est["solver_s"], "profiled_ops": est["profiled_ops"],
                            "cached_ops": est["cached_ops"], "nodes": len(graph.nodes)}
        again = [row.pop(f"again{i}") for i in range(args.search_repeats)]
        row["second"] = min(again, key=lambda a: a["search_s"])  # least disturbed by other load
        row["second"]["search_s_all"] = [a["search_s"] for a in again]
        row["second"]["trace_s"] = min(a["trace_s"] for a in again)
        rows.append(row)
    sec = [r["second"]["search_s"] for r in rows]
    lay = [r["layers"] for r in rows]
    out = {"rows": rows, "config": f"GPT n_embd 64, 4 heads, T 32, vocab 256, batch 2, "
                                   f"ComputeConfig({args.depth_ngpus}, {args.depth_ngpus})"}
    if len(rows) >= 2:
        k = math.log(sec[-1] / sec[0]) / math.log(lay[-1] / lay[0])
        out["search_exponent_k"] = k
        out["search_ratio_last_over_first"] = sec[-1] / sec[0]
        out["layer_ratio"] = lay[-1] / lay[0]
    if 32 in lay:
        s32 = sec[lay.index(32)]
        out["search_s_32"] = s32
        out["target_32_met"] = s32 <= TARGET_SEARCH_32
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="*", default=["gpt", "llama"], choices=["gpt", "llama"])
    p.add_argument("--ranks", nargs="*", type=int, default=[2, 4])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--embd", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=0, help="Llama intermediate size (default 4 x embd)")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per micro-batch (global)")
    p.add_argument("--nmicros", type=int, default=2, help="micro-batches per step (update_freq)")
    p.add_argument("--pipe-embd", type=int, default=256, help="(c) the pipeline case's width")
    p.add_argument("--pipe-seq", type=int, default=16, help="(c) the pipeline case's sequence length")
    p.add_argument("--pipe-nmicros", type=int, default=4, help="(c) the pipeline case's micro-batches per step")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--settle", type=int, default=1,
                   help="untimed steps of a plan before its timed one in each round (training runs one plan back to back)")
    p.add_argument("--depths", nargs="*", type=int, default=[4, 8, 16, 32, 64])
    p.add_argument("--search-repeats", type=int, default=3, help="timed runs per depth after the first (best kept)")
    p.add_argument("--depth-ngpus", type=int, default=4, help="(3) the devices the depth search plans for")
    p.add_argument("--cache-dir", default=None, help="NNSCALER_CACHE_DIR (default: a fresh temporary directory)")
    p.add_argument("--out", default=str(_common.RESULTS_DIR / "autodist.json"))
    args = _common.parse_args(p, {"models": ["gpt"], "ranks": [2], "layers": 2, "embd": 32, "seq": 16, "micro_batch": 4,
                                  "rounds": 1, "warmup": 1, "settle": 0, "depths": [2, 4], "search_repeats": 1,
                                  "pipe_embd": 32, "pipe_seq": 8,
                                  "depth_ngpus": 2},  # fewer partitions to profile (the test suite's time)
                              "autodist.json")
    start = time.perf_counter()
    cache = args.cache_dir or tempfile.mkdtemp(prefix="nnscaler_bench_autodist_")
    os.environ["NNSCALER_CACHE_DIR"] = cache
    data = _common.run_header()
    data["loadavg_start"] = _common.loadavg()
    data["config"] = {k: v for k, v in vars(args).items()}
    data["cache_dir"] = cache
    # 0. the comm profile, measured once
    from nnscaler.policies.autodist.comm_profile import measured_comm_model
    from nnscaler.policies.autodist.op_profile import cache_dir
    t0 = time.perf_counter()
    for R in sorted(args.ranks):  # every group size of an R-rank job, measured as that job runs them
        comm = measured_comm_model([n for n in range(2, R + 1) if R % n == 0], "cpu", world=R)
    data["comm_profile"] = {"seconds": time.perf_counter() - t0, "worlds": sorted(args.ranks),
                            "profile": comm.profile, "path": str(cache_dir() / "autodist")}
    print(f"comm profile: {data['comm_profile']['seconds']:.1f} s for jobs of {sorted(args.ranks)} processes",
          flush=True)
    for c, table in comm.profile["collectives"].items():
        print("  " + c + ": " + ", ".join(f"n={n}: {lat * 1e6:.0f} us + B / {bw / 1e9:.2f} GB/s" for n, (lat, bw, *_) in table.items()))
    # 1. plan quality
    data["plan_quality"] = []
    for name in args.models:
        for R in args.ranks:
            t = time.perf_counter()
            try:
                res = plan_quality(args, name, R, True)
            except Exception:  # noqa: BLE001 - keep the other cases
                res = {"model": name, "ranks": R, "error": traceback.format_exc()[-3000:]}
            res["seconds"] = time.perf_counter() - t
            data["plan_quality"].append(res)
            _print_case(res)
            t = time.perf_counter()
            try:
                res = pipeline_case(args, name, R)
            except Exception:  # noqa: BLE001 - keep the other cases
                res = {"model": name, "ranks": R, "error": traceback.format_exc()[-3000:]}
            res["seconds"] = time.perf_counter() - t
            data.setdefault("pipeline_case", []).append(res)
            _print_case(res)
    # 3. search time against depth
    if args.depths:
        data["search_depth"] = search_depth(args)
        _print_depth(data["search_depth"])
    data["loadavg_end"] = _common.loadavg()
    data["total_s"] = time.perf_counter() - start
    print(f"total {data['total_s']:.0f} s")
    _common.save_results(args.out, data)


def _mb(b):
    return "-" if b is None else f"{b / 2 ** 20:.1f}"


def _print_case(res: dict) -> None:
    head = f"\n== {res['model'] if isinstance(res['model'], str) else res['model']['name']}, {res['ranks']} ranks"
    head += " (c: pipeline case, no op split)" if "constraints" in res else ""
    print(head + f" ({res.get('seconds', 0):.0f} s)")
    if "error" in res:
        print(res["error"])
        return
    rows = []
    for lab, r in res["runs"].items():
        if "error" in r:
            rows.append([lab, "error", "-", "-", "-", r["error"][:60]])
        else:
            rows.append([lab, f"{r['step_s_median'] * 1e3:.1f}", f"{r['optimizer_s_mean'] * 1e3:.1f}",
                         f"{r['on_cpu_share']:.2f}", _mb(r["peak_bytes_max"]), ""])
    print(_common.table(["plan", "step ms", "opt ms", "on-CPU", "peak MiB", "note"], rows))
    rows = []
    for lim, e in res["limits"].items():
        if "skipped" in e:
            rows.append([lim, "-" if e["limit_gb"] is None else f"{e['limit_gb'] * 1024:.1f}", "skipped: " + e["skipped"][:50],
                         "", "", "", "", "", "", ""])
            continue
        f = lambda x, fmt: "-" if x is None else fmt.format(x)  # noqa: E731
        rows.append([lim, "-" if e["limit_gb"] is None else f"{e['limit_gb'] * 1024:.1f}", e["autodist_label"],
                     f(e["autodist_measured_step_s"] and e["autodist_measured_step_s"] * 1e3, "{:.1f}"),
                     f"{e['best_baseline']} {f(e['best_baseline_step_s'] and e['best_baseline_step_s'] * 1e3, '{:.1f}')}",
                     f(e["ratio_autodist_over_best"], "{:.3f}") if not e["only_autodist_fits"] else "only autodist fits",
                     f(e["ratio_min_over_min"], "{:.3f}"), f(e["estimated_over_measured_step"], "{:.2f}"),
                     f(e["estimated_over_measured_cpu"], "{:.2f}"),
                     f(e["estimated_over_measured_mem"], "{:.2f}")])
    print(_common.table(["limit", "MiB", "autodist plan", "ms", "best that fits (ms)", "ratio", "min/min", "est/meas t", "est/cpu t",
                         "est/meas mem"], rows))
    if "compute_model_check" not in res:  # the pipeline case
        return
    c = res["compute_model_check"]
    print(f"compute model: profiled ops {c['profiled_ops_sum_s'] * 1e3:.1f} ms vs eager fwd+bwd {c['eager_fwd_bwd_median_s'] * 1e3:.1f} ms "
          f"(min {c['eager_fwd_bwd_min_s'] * 1e3:.1f}) -> {c['profiled_over_eager']:.2f}; load {c['loadavg']}")
    print("nothing fits:", (res["nothing_fits"]["error"] or "")[:300])


def _print_depth(d: dict) -> None:
    rows = [[r["layers"], r["second"]["nodes"], f"{r['second']['trace_s']:.3f}", f"{r['second']['search_s']:.3f}",
             f"{r['second']['solver_s']:.3f}", r["second"]["cached_ops"], r["second"]["profiled_ops"],
             f"{r['first']['search_s']:.3f}"] for r in d["rows"]]
    print(f"\n== search time against depth ({d['config']}, second run)")
    print(_common.table(["layers", "nodes", "trace s", "search s", "solver s", "cached", "profiled", "first search s"], rows))
    if "search_exponent_k" in d:
        print(f"exponent k = {d['search_exponent_k']:.2f}; 32 layers: {d.get('search_s_32')}")


if __name__ == "__main__":
    main()
