"""Mixture of experts: nnscaler's `ep` policy against `dp` on DeepSeek-V3-style routing (or a Mixtral),
2 and 4 ranks of this machine, in one run.

    python bench/moe.py [--model deepseek_v3|mixtral] [--nprocs 2 4] [--hidden 256] [--intermediate 512]
                        [--layers 2] [--experts 8] [--top-k 2] [--n-group 4] [--topk-group 2]
                        [--seq 128] [--batch 8] [--rounds 10] [--parts time memory]

The model (default `--model deepseek_v3`) is transformers' `DeepseekV3ForCausalLM` built from a config
in code: DeepSeek-V3's routing (sigmoid scores, group-limited top-k: the experts in `--n-group`
groups, each token's `--top-k` experts taken from its `--topk-group` best groups, the router bias
`e_score_correction_bias` added for the choice), one shared expert, every layer an MoE layer
(`first_k_dense_replace` 0), MLA attention; `--model mixtral` a `MixtralForCausalLM` (softmax top-k).
Nothing downloaded; seed-0 weights, float32, `experts_implementation="eager"` (transformers' own
experts module, which nnscaler traces to its one `routed_experts` op whatever the implementation), sdpa
attention, no dropout, wrapped so that forward(input_ids, labels) returns the next-token
cross-entropy. No load-balancing loss (DeepSeek-V3 has none; the Mixtral's coefficient is 0): under
`dp` each rank's would see 1/n of the batch, under `ep` the whole batch, so the two would train
different objectives; without it they train the same one and their losses must agree within
`--loss-rtol` (float32 rounding). Adam (lr 1e-3). For each n of `--nprocs` (2 and 4) in turn: n gloo
processes, each with max(1, cores // n) intra-op threads, the same global batch of `--batch`
sequences of `--seq` random tokens a step (step s: generator seed 1000 + s):

* `dp` : `parallelize(model, sample, "dp", ComputeConfig(1, n))`: every rank the whole model and
         rows [r*B/n, (r+1)*B/n) of the batch; the gradients all-reduced;
* `ep` : `parallelize(model, sample, "ep", ComputeConfig(n, n))`: one unit of n ranks; each MoE
         layer's experts split over it (rank r holds experts [r*E/n, (r+1)*E/n)), the tokens sent
         to their experts' ranks and back by all-to-all (`nnscaler.runtime.moe.expert_parallel`);
         every other op split along its first input's leading dim, or replicated where that does
         not split (the policy's rule). Every rank passes the whole batch; the generated code takes
         its rows.

Both with `build_optimizer(pm, torch.optim.Adam)`. A step is `zero_grad`, forward (the loss),
backward, `step`.

**1. Step time** (`--parts time`; one spawn, both cases built in the same processes, glibc's
default malloc settings): `--warmup` (2) untimed steps of each, then `--rounds` (10) rounds in
which each case runs a block of `--block` (2) steps, the order rotated every round, a barrier
before every block; a block's time is that of the slower rank. Reported: the median ms/step over
the blocks, tokens/s = batch * seq / that median, the ratio ep/dp of the medians and the median of
the per-round ratios ("paired"); forward / backward / optimizer ms of rank 0 (means). In the same
processes: the parameter bytes each rank holds (its local parameters: the experts' -
`gate_up_proj` and `down_proj` of every layer - and in all), the bytes of the tensors held between
steps (parameters, gradients, Adam state, reducer buffers: distinct storages) and, for every step,
the collectives it ran (`nnscaler.runtime.comm.stats.count_collectives()`: calls and payload bytes
by collective) and, under `ep`, the rows each expert received (`nnscaler.runtime.moe.expert_load()`).

**All-to-all bytes, analytic.** Payload convention of stats.py: the bytes a rank hands into the
collective (the rows it sends to itself included). With L MoE layers, T = batch * seq tokens a
step, top-k k, hidden size h, b bytes an element (4: float32) and n ranks in the unit, rank r
holds T/n tokens, i.e. T*k/n (token, expert) rows, and receives R_r rows for its own experts
(R_r: the rows routed to experts [r*E/n, (r+1)*E/n), from every rank). Per layer and step it hands
into the all-to-all

    forward  dispatch  T*k/n * h * b     (its rows to their experts' ranks)
    forward  combine   R_r   * h * b     (its experts' outputs back to the tokens' ranks)
    backward combine   T*k/n * h * b     (the gradients of the combined rows, the other way)
    backward dispatch  R_r   * h * b

so   bytes_r = 2 * L * (T*k/n + R_r) * h * b   in 4 * L calls,  and, as sum_r R_r = T*k,

    sum over the unit's ranks = 4 * L * T * k * h * b      (whatever the routing)
    mean per rank             = 4 * L * (T/n) * k * h * b  (each rank sends its tokens * top_k rows
                                                            in dispatch and as many in combine; the
                                                            backward the same again)

Reported: measured / analytic for the unit's total (`sum_over_ranks`, 1.0 exactly), for each rank
against its exact count with its R_r read from `expert_load()` (1.0 exactly) and against the
balanced count 4 * L * (T/n) * k * h * b (off by the routing's imbalance: R_r differs from T*k/n);
the wire bytes (ring / pairwise: (n-1)/n of the payload) next to `dp`'s all-reduce of the
gradients. The counts of the experts exchange (an all-gather of E int64 per layer) are not
recorded by stats.py (label None).

**2. Memory** (`--parts memory`; one spawn per case, so a case's memory is its own): the workers
run with glibc's `MALLOC_MMAP_THRESHOLD_=65536` and `MALLOC_TRIM_THRESHOLD_=131072`, set in the
parent before the spawn (`--no-malloc-env` drops them), so that every allocation above 64 KiB is
its own mapping, unmapped when freed, and RSS follows the live tensors. Each rank records its RSS
after one Adam step of a tiny single-device Mixtral and one of each collective, released
(`baseline`: torch, transformers, gloo, nnscaler, code pages, thread pools), builds (single-device
model, parallelized module, optimizer; the single-device model dropped), runs `--mem-warmup` (1)
steps (Adam's state then exists), `gc.collect()` + `malloc_trim(0)`, resets its peak RSS
(`echo 5 > /proc/self/clear_refs`: VmHWM := VmRSS) and runs `--mem-steps` (3) steps; the
**steady-state peak RSS** is VmHWM after them (and at least the largest VmRSS a thread sampled
every 2 ms): the one-off build, which holds the whole model on every rank, is excluded (its peak
is `build_peak`). Also: the RSS at the reset (`steady`) and the peak above it (`transient`), the
peak above the baseline. Each case's figure is its larger rank.

Ratios ep/dp (`ratios`): expert parameter bytes per rank (1/n: each rank holds E/n experts), total
parameter bytes per rank, held tensors per rank, steady-state peak RSS, step time, tokens/s.
Writes bench/results/moe.json (`--out`): the first n's figures at the top level and every n's under
`by_nproc`; `--smoke` a tiny model, a few steps, both parts, 2 ranks only.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402
import _rss  # noqa: E402
from _common import fmt_mib  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _causal_lm import CausalLMLoss  # noqa: E402

CASES = ("dp", "ep")
LABELS = {"dp": "nnscaler dp: ComputeConfig(1, n)", "ep": "nnscaler ep: ComputeConfig(n, n)"}
A2A = ("all_to_all", "all_to_all" + _common.FALLBACK)
WARM_UP_COLLECTIVES = ("all_reduce", "all_to_all", "all_gather")  # those the cases use


# -- the model ------------------------------------------------------------------------------------

def _mixtral(a: dict, seed: int = 0) -> CausalLMLoss:
    from transformers import MixtralConfig, MixtralForCausalLM
    cfg = MixtralConfig(vocab_size=a["vocab"], hidden_size=a["hidden"], intermediate_size=a["intermediate"],
                        num_hidden_layers=a["layers"], num_attention_heads=a["heads"],
                        num_key_value_heads=a["kv_heads"], num_local_experts=a["experts"],
                        num_experts_per_tok=a["top_k"], max_position_embeddings=a["seq"], attention_dropout=0.0,
                        router_aux_loss_coef=0.0, attn_implementation="sdpa", experts_implementation="eager",
                        use_cache=False, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return CausalLMLoss(MixtralForCausalLM(cfg)).float().train()


def _deepseek_v3(a: dict, seed: int = 0) -> CausalLMLoss:
    """DeepSeek-V3's routing: sigmoid scores, group-limited top-k (the experts in n_group groups, each
    token's top-k taken from its topk_group best groups), a bias added to the scores for the choice
    (e_score_correction_bias, zero here), one shared expert; every layer an MoE layer."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    rank = max(8, a["hidden"] // 4)
    cfg = DeepseekV3Config(vocab_size=a["vocab"], hidden_size=a["hidden"], intermediate_size=a["intermediate"],
                           moe_intermediate_size=a["intermediate"], num_hidden_layers=a["layers"],
                           num_attention_heads=a["heads"], num_key_value_heads=a["heads"],
                           n_routed_experts=a["experts"], num_experts_per_tok=a["top_k"], n_shared_experts=1,
                           n_group=a["n_group"], topk_group=a["topk_group"], first_k_dense_replace=0,
                           q_lora_rank=rank, kv_lora_rank=rank, qk_rope_head_dim=16, qk_nope_head_dim=16,
                           v_head_dim=16, max_position_embeddings=a["seq"], attention_dropout=0.0,
                           attn_implementation="sdpa", experts_implementation="eager", use_cache=False,
                           tie_word_embeddings=False)
    torch.manual_seed(seed)
    return CausalLMLoss(DeepseekV3ForCausalLM(cfg)).float().train()


def _model(a: dict, seed: int = 0) -> CausalLMLoss:
    return _deepseek_v3(a, seed) if a["model"] == "deepseek_v3" else _mixtral(a, seed)


def _global_batch(a: dict, step: int) -> dict:
    g = torch.Generator().manual_seed(1000 + step)
    shape = (a["batch"], a["seq"])
    return {"input_ids": torch.randint(0, a["vocab"], shape, generator=g),
            "labels": torch.randint(0, a["vocab"], shape, generator=g)}


def _inputs(case: str, a: dict, rank: int, world: int, step: int) -> dict:
    """What rank `rank` passes to the module at `step`: under dp its rows, under ep the whole batch."""
    full = _global_batch(a, step)
    if case == "ep":
        return full
    per = a["batch"] // world
    return {k: v[rank * per:(rank + 1) * per].contiguous() for k, v in full.items()}


def _is_expert(name: str) -> bool:
    return ".experts." in name


def _build(case: str, a: dict, world: int, gen_dir: str):
    """(parallelized module, optimizer, parameters of the single-device model, its expert parameters)."""
    from nnscaler import ComputeConfig, build_optimizer, parallelize
    base = _model(a)
    n_params = sum(p.numel() for p in base.parameters())
    n_expert = sum(p.numel() for n, p in base.named_parameters() if _is_expert(n))
    plan = world if case == "ep" else 1
    cc = ComputeConfig(plan, world, trace_strategy="cpu")
    pm = parallelize(base, _inputs(case, a, 0, world, 0), case, cc, gen_savedir=gen_dir,
                     instance_name=f"moe_{case}_{a['tag']}", reuse="override")
    pm.train()
    opt = build_optimizer(pm, torch.optim.Adam, lr=a["lr"])
    del base
    return pm, opt, n_params, n_expert


def _param_bytes(pm) -> dict:
    """This rank's local parameters: expert (gate_up_proj, down_proj) and all, in bytes and elements,
    and the local / full shapes of the first expert weight."""
    named = dict(pm.named_parameters())
    out = {"total": 0, "expert": 0, "total_numel": 0, "expert_numel": 0, "expert_shapes": {}}
    for local, entry in pm.fullmap.items():
        p = named.get(local)
        if p is None:
            continue
        nbytes = p.numel() * p.element_size()
        out["total"] += nbytes
        out["total_numel"] += p.numel()
        if _is_expert(entry.full_name):
            out["expert"] += nbytes
            out["expert_numel"] += p.numel()
            if len(out["expert_shapes"]) < 2:
                out["expert_shapes"][entry.full_name] = {"local": list(p.shape), "full": list(entry.full_shape)}
    counted = sum(p.numel() for p in named.values())
    assert counted == out["total_numel"], (counted, out["total_numel"])  # every parameter is in the fullmap
    return out


# -- part 1: step time, parameter bytes, collectives ----------------------------------------------

_EXCHANGES: dict = {}  # collective -> {"calls", "bytes"}: the expert-parallel exchanges since the last clear
_WRAPPED = False


def _expert_exchanges() -> dict:
    """The collectives of the expert-parallel exchanges alone: `nnscaler.runtime.comm.exchange._exchange`
    (behind `exchange_rows`: the rows to the experts' ranks and back, forward and backward: one
    all-to-all each call; no other op of this model exchanges rows) is wrapped, once per process, in
    a `count_collectives()` block whose counts are added to the dict returned. A step's own
    `count_collectives()` block sees these too, and the plan's other all-to-alls (adapters between
    layouts) besides."""
    global _WRAPPED
    if not _WRAPPED:
        import nnscaler.runtime.comm.exchange as rt_exchange
        from nnscaler.runtime.comm.stats import count_collectives
        inner = rt_exchange._exchange

        def counted(*args, **kwargs):
            with count_collectives() as st:
                out = inner(*args, **kwargs)
            for key, v in st.snapshot().items():
                mine = _EXCHANGES.setdefault(key, {"calls": 0, "bytes": 0})
                mine["calls"] += v["calls"]
                mine["bytes"] += v["bytes"]
            return out
        rt_exchange._exchange = counted
        _WRAPPED = True
    return _EXCHANGES


def _counted_step(case, built, b, phases, rank, world, a):
    """One step inside count_collectives(); (loss, its collectives, those of the expert-parallel
    exchanges alone, rows received by this rank's experts per MoE call (ep))."""
    from nnscaler.runtime.comm.stats import count_collectives
    from nnscaler.runtime.moe import expert_load
    load, exchanges = expert_load(), _expert_exchanges()
    load.reset()
    exchanges.clear()
    with count_collectives() as stats:
        loss = _common.timed_step(*built, b, phases)
    local = a["experts"] // world
    received = [int(c[rank * local:(rank + 1) * local].sum()) for c in load.per_call] if case == "ep" else []
    load.reset()
    return loss, stats.snapshot(), {k: dict(v) for k, v in sorted(exchanges.items())}, received


def time_cases(rank: int, cases: list, a: dict, gen_dir: str) -> dict:
    world = dist.get_world_size()
    nsteps = a["warmup"] + a["rounds"] * a["block"]
    built, build_s, params, held, sizes = {}, {}, {}, {}, {}
    for c in cases:
        t0 = time.perf_counter()
        pm, opt, n_params, n_expert = _build(c, a, world, gen_dir)
        built[c] = (pm, opt)
        build_s[c] = time.perf_counter() - t0
        params[c] = _param_bytes(pm)
        sizes = {"params": n_params, "expert_params": n_expert}
        gc.collect()
    done = {c: 0 for c in cases}
    losses = {c: [] for c in cases}
    comm = {c: [] for c in cases}
    received = {c: [] for c in cases}
    exchanges = {c: [] for c in cases}
    phases = {c: [0.0, 0.0, 0.0] for c in cases}

    def run(c, n, ph=None):
        out = []
        for _ in range(n):
            loss, st, ex, rec = _counted_step(c, built[c], _inputs(c, a, rank, world, done[c]), ph, rank, world, a)
            out.append(loss)
            comm[c].append(st)
            exchanges[c].append(ex)
            received[c].append(rec)
            done[c] += 1
        return out

    for c in cases:
        losses[c].extend(x.item() for x in run(c, a["warmup"]))
        held[c] = _rss.held_bytes(*built[c])  # gradients and Adam state exist after a step
    times, rounds = _common.interleaved_rounds(cases, a["rounds"], a["block"],
                                               lambda c: run(c, a["block"], phases[c]), losses)
    for c in cases:
        losses[c] = [x / world for x in _common.all_reduce_floats(losses[c])]
    nsteps_timed = a["rounds"] * a["block"]
    assert all(done[c] == nsteps for c in cases)
    return {"rank": rank, "build_s": build_s, "step_s": times, "rounds": rounds, "losses": losses,
            "phases_ms": {c: [1e3 * x / max(1, nsteps_timed) for x in ph] for c, ph in phases.items()},
            "param_bytes": params, "held_bytes": held, "sizes": sizes, "collectives": comm,
            "expert_exchanges": exchanges, "received_rows": received}


# -- part 2: memory of one case in its own processes ----------------------------------------------

def _tiny_step() -> None:
    """One Adam step of a tiny single-device Mixtral: `_rss.baselines`' warm-up."""
    tiny = dict(vocab=64, hidden=32, intermediate=48, layers=1, heads=4, kv_heads=2, experts=4, top_k=2, seq=8)
    m = _mixtral(tiny, seed=1)
    o = torch.optim.Adam(m.parameters(), lr=1e-3)
    m(**_global_batch(dict(tiny, batch=2), 0)).backward()
    o.step()


def memory_case(rank: int, case: str, a: dict, gen_dir: str) -> dict:
    """Build, `mem_warmup` steps, reset the peak RSS, `mem_steps` steps."""
    world = dist.get_world_size()
    baseline_cold, baseline = _rss.baselines(_tiny_step, WARM_UP_COLLECTIVES)
    t0 = time.perf_counter()
    model, opt, _, _ = _build(case, a, world, gen_dir)
    build_s = time.perf_counter() - t0

    def step(b):
        return _common.timed_step(model, opt, b).item()
    losses = [step(_inputs(case, a, rank, world, s)) for s in range(a["mem_warmup"])]
    _rss.release()
    build_peak = _rss.status("VmHWM")
    held = _rss.held_bytes(model, opt)
    params = _param_bytes(model)
    dist.barrier()
    m = _rss.steady_state_peak(step, (_inputs(case, a, rank, world, s)
                                      for s in range(a["mem_warmup"], a["mem_warmup"] + a["mem_steps"])))
    losses = [x / world for x in _common.all_reduce_floats(losses + m.losses)]
    del model, opt
    dist.barrier()
    return {"rank": rank, "case": case, "baseline_cold_rss": baseline_cold, "baseline_rss": baseline,
            "build_peak": build_peak, "build_s": build_s, "held_bytes": held, "param_bytes": params,
            "steady_rss": m.steady, "peak_rss": m.peak, "sampled_peak_rss": m.sampled,
            "peak_rss_per_step": m.per_step, "peak_above_baseline": m.peak - baseline, "transient": m.peak - m.steady,
            "step_s": m.step_s, "losses": losses}


# -- driver ---------------------------------------------------------------------------------------

def _a2a_bytes(snapshot: dict) -> tuple:
    return (sum(snapshot.get(k, {}).get("bytes", 0) for k in A2A),
            sum(snapshot.get(k, {}).get("calls", 0) for k in A2A))


def _wire(key: str, payload: int, n: int):
    """Ring / pairwise wire bytes a rank sends (bench/_common.py); the data-parallel reducer's
    ``dp_all_reduce`` is an all-reduce. None for a collective without a model."""
    w = _common.wire_bytes(key[3:] if key.startswith("dp_") else key, payload, n)
    return None if w != w else w


def _all_to_all_report(timing: list, a: dict, n: int) -> dict:
    """The expert-parallel exchanges' all-to-all payload on every step of part 1 against the analytic
    counts (module docstring), and the step's other collectives."""
    L, k, h, b = a["layers"], a["top_k"], a["hidden"], 4
    T = a["batch"] * a["seq"]
    unit = 4 * L * T * k * h * b
    balanced = 4 * L * (T // n) * k * h * b
    steps, exact_every_step = [], True
    for s in range(len(timing[0]["expert_exchanges"]["ep"])):
        measured = [_a2a_bytes(r["expert_exchanges"]["ep"][s]) for r in timing]
        in_step = [_a2a_bytes(r["collectives"]["ep"][s]) for r in timing]
        total = sum(m[0] for m in measured)
        row = {"step": s, "measured_bytes_sum_over_ranks": total, "measured_over_analytic": total / unit,
               "per_rank": []}
        ok = total == unit
        for r, rr in enumerate(timing):
            rec = rr["received_rows"]["ep"][s]
            exact = sum(2 * (T * k // n + x) * h * b for x in rec)
            ok &= len(rec) == L and measured[r][0] == exact and measured[r][1] == 4 * L
            row["per_rank"].append({
                "rank": r, "measured_bytes": measured[r][0], "calls": measured[r][1], "analytic_bytes_exact": exact,
                "measured_over_exact": measured[r][0] / exact, "measured_over_balanced": measured[r][0] / balanced,
                "rows_received_per_layer": rec, "step_all_to_all_bytes": in_step[r][0],
                "step_all_to_all_calls": in_step[r][1]})
        row["exact"] = ok
        exact_every_step &= ok
        steps.append(row)
    dp_exchanges = [x for r in timing for x in r["expert_exchanges"]["dp"] if x]
    ratios = [x["measured_over_analytic"] for x in steps]
    first = steps[-1]  # the last step: all are reported in "steps"
    per_step = {}
    for case in timing[0]["collectives"]:
        snap = timing[0]["collectives"][case][-1]  # rank 0, the last step
        per_step[case] = {key: {**v, "wire_bytes": _wire(key, v["bytes"], n)} for key, v in snap.items()}
    return {
        "formula": "per MoE layer and step, rank r hands into the all-to-all T*k/n*h*b (forward dispatch) + R_r*h*b "
                   "(forward combine) + T*k/n*h*b (backward of combine) + R_r*h*b (backward of dispatch), in 4 calls; "
                   "R_r = rows routed to rank r's experts, sum_r R_r = T*k; so the sum over the ranks is "
                   "4*L*T*k*h*b and the mean per rank 4*L*(T/n)*k*h*b (payload: bytes handed into the collective)",
        "L": L, "T_tokens_per_step": T, "top_k": k, "hidden": h, "bytes_per_element": b, "n": n,
        "analytic_bytes_per_step_sum_over_ranks": unit, "analytic_bytes_per_step_per_rank_mean": unit // n,
        "analytic_calls_per_step_per_rank": 4 * L,
        "measured_bytes_per_step_sum_over_ranks": first["measured_bytes_sum_over_ranks"],
        "measured_bytes_per_step_per_rank": [p["measured_bytes"] for p in first["per_rank"]],
        "measured_over_analytic": first["measured_over_analytic"],
        "measured_over_analytic_min_max_over_steps": [min(ratios), max(ratios)],
        "per_rank_measured_over_exact": [p["measured_over_exact"] for p in first["per_rank"]],
        "per_rank_measured_over_balanced": [p["measured_over_balanced"] for p in first["per_rank"]],
        "exact_every_step": exact_every_step and not dp_exchanges, "steps_checked": len(steps),
        "wire_bytes_per_step_per_rank_mean": _wire("all_to_all", unit // n, n),
        "step_all_to_all_bytes_per_rank": [p["step_all_to_all_bytes"] for p in first["per_rank"]],
        "adapter_all_to_all_bytes_per_rank": [p["step_all_to_all_bytes"] - p["measured_bytes"]
                                              for p in first["per_rank"]],
        "adapter_note": "the step's other all-to-alls: adapters of the ep plan between layouts (not the experts')",
        "collectives_per_step_rank0": per_step,
        "steps": steps,
    }


def _run(args, n: int) -> dict:
    """Both parts on `n` ranks: the report printed, the figures returned."""
    t_start = time.perf_counter()
    load_before = _common.loadavg()
    cases = list(CASES)
    a = {k: getattr(args, k) for k in ("vocab", "hidden", "intermediate", "layers", "heads", "kv_heads", "experts",
                                       "top_k", "seq", "batch", "lr", "warmup", "rounds", "block", "mem_warmup",
                                       "mem_steps", "model", "n_group", "topk_group")}
    a["nproc"] = n
    a["tag"] = f"{args.model}_{n}"
    threads = _common.threads_per_rank(n)
    tokens = args.batch * args.seq
    print(f"{args.model} {args.layers} layers x {args.hidden} (experts {args.experts} x {args.intermediate}, top-"
          f"{args.top_k}), seq {args.seq}, {args.batch} sequences a step ({tokens} tokens); {n} gloo processes x "
          f"{threads} thread(s)", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        gen = os.path.join(tmp, "gen")
        timing, time_spawn_s = _rss.spawn(time_cases, (cases, a, gen), n, os.path.join(tmp, "time.json"), False)
        print(f"part 1 (step time, parameters, collectives): {time_spawn_s:.1f} s", flush=True)
        mem = {}
        for c in (cases if "memory" in args.parts else []):
            ranks, s = _rss.spawn(memory_case, (c, a, gen), n, os.path.join(tmp, f"mem_{c}.json"),
                                  not args.no_malloc_env)
            mem[c] = _rss.mem_summary(c, LABELS[c], ranks, s)
            print(f"part 2 (memory) {c}: peak RSS {fmt_mib(mem[c]['peak_rss'])} MiB ({s:.1f} s)", flush=True)

    # -- report ------------------------------------------------------------------------------------
    r0 = timing[0]
    step = {c: statistics.median(r0["step_s"][c]) for c in cases}
    tps = {c: tokens / step[c] for c in cases}
    params = {c: {"per_rank": [r["param_bytes"][c] for r in timing],
                  "expert_bytes": max(r["param_bytes"][c]["expert"] for r in timing),
                  "total_bytes": max(r["param_bytes"][c]["total"] for r in timing),
                  "held_bytes": max(r["held_bytes"][c] for r in timing)} for c in cases}
    sizes = r0["sizes"]
    a2a = _all_to_all_report(timing, a, n)
    loss_diff = _common.max_rel_diff(r0["losses"]["ep"], r0["losses"]["dp"])
    losses_ok = loss_diff <= args.loss_rtol
    if mem:
        for c in cases:
            mem[c]["loss_rel_diff_vs_part1"] = _common.max_rel_diff(mem[c]["losses"], r0["losses"][c])
    print(f"\n== {args.model} {args.layers} x {args.hidden}: {sizes['params']:,} parameters, {sizes['expert_params']:,} "
          f"in experts; Adam fp32; {n} gloo ranks x {threads} thread(s); {tokens} tokens a step ==")
    head = ["case", "step ms (median)", "min", "fwd / bwd / opt ms", "tokens/s", "expert params MiB/rank",
            "params MiB/rank", "held tensors MiB/rank"]
    if mem:
        head += ["baseline RSS", "steady RSS", "peak RSS", "peak - baseline"]
    head += ["experts' all-to-all MiB/step/rank", "final loss"]
    rows = []
    for c in cases:
        ph = r0["phases_ms"][c]
        pb = params[c]
        row = [c, f"{step[c] * 1e3:,.0f}", f"{min(r0['step_s'][c]) * 1e3:,.0f}",
               f"{ph[0]:,.0f} / {ph[1]:,.0f} / {ph[2]:,.0f}", f"{tps[c]:,.0f}", fmt_mib(pb["expert_bytes"]),
               fmt_mib(pb["total_bytes"]), fmt_mib(pb["held_bytes"])]
        if mem:
            m = mem[c]
            row += [fmt_mib(m["baseline_rss"]), fmt_mib(m["steady_rss"]), fmt_mib(m["peak_rss"]),
                    fmt_mib(m["peak_above_baseline"])]
        row += [fmt_mib(max(_a2a_bytes(r["expert_exchanges"][c][-1])[0] for r in timing)),
                f"{r0['losses'][c][-1]:.6f}"]
        rows.append(row)
    print(_common.table(head, rows))
    print("MiB; per case its larger rank. held tensors: parameters, gradients, Adam state, reducer buffers; RSS: "
          "baseline after a tiny Mixtral's step, steady at the reset after the warm-up, peak over the steps after it")
    print(f"loss rel diff ep vs dp (every step of part 1): {loss_diff:.1e} ({'ok' if losses_ok else 'NOT OK'}, "
          f"rtol {args.loss_rtol})")
    print(f"\nexperts' all-to-all payload a step (ep, L={a2a['L']}, T={a2a['T_tokens_per_step']}, k={a2a['top_k']}, "
          f"h={a2a['hidden']}, b=4, n={n}): measured {a2a['measured_bytes_per_step_sum_over_ranks']:,} B over the "
          f"ranks, "
          f"analytic 4*L*T*k*h*b = {a2a['analytic_bytes_per_step_sum_over_ranks']:,} B: measured/analytic "
          f"{a2a['measured_over_analytic']:.6f}; exact on every rank and step ({a2a['steps_checked']}): "
          f"{a2a['exact_every_step']}. Per rank against 4*L*(T/n)*k*h*b = "
          f"{a2a['analytic_bytes_per_step_per_rank_mean']:,} B: "
          + ", ".join(f"{x:.3f}" for x in a2a["per_rank_measured_over_balanced"])
          + " (the routing's imbalance: R_r is not T*k/n)")
    print(f"the ep step's other all-to-alls (adapters between layouts), per rank: "
          + ", ".join(f"{x:,} B" for x in a2a["adapter_all_to_all_bytes_per_rank"]))
    print("collectives a step, rank 0: " + "; ".join(
        f"{c}: " + ", ".join(f"{k} {v['calls']} x {fmt_mib(v['bytes'])} MiB"
                             for k, v in r0["collectives"][c][-1].items())
        for c in cases))
    ratios = {"expert_param_bytes_per_rank ep/dp": params["ep"]["expert_bytes"] / params["dp"]["expert_bytes"],
              "param_bytes_per_rank ep/dp": params["ep"]["total_bytes"] / params["dp"]["total_bytes"],
              "held_bytes_per_rank ep/dp": params["ep"]["held_bytes"] / params["dp"]["held_bytes"],
              "step_time ep/dp": step["ep"] / step["dp"],
              "step_time ep/dp (paired)": statistics.median(rd["ep"] / rd["dp"] for rd in r0["rounds"]),
              "tokens_per_s ep/dp": tps["ep"] / tps["dp"]}
    if mem:
        ratios["peak_rss ep/dp"] = mem["ep"]["peak_rss"] / mem["dp"]["peak_rss"]
        ratios["peak_above_baseline ep/dp"] = mem["ep"]["peak_above_baseline"] / mem["dp"]["peak_above_baseline"]
        ratios["steady_rss ep/dp"] = mem["ep"]["steady_rss"] / mem["dp"]["steady_rss"]
    print()
    print(_common.table(["ratio", "value"], [[k, f"{v:.3f}"] for k, v in ratios.items()]))
    elapsed = time.perf_counter() - t_start
    print(f"\ntotal {elapsed:.0f} s; load average before {load_before}, after {_common.loadavg()}")
    data = {**_common.run_header(),
            "config": {**vars(args), "nproc": n, "threads_per_rank": threads, "tokens_per_step": tokens,
                       "malloc_env": None if args.no_malloc_env else _rss.MALLOC_ENV, "dtype": "float32",
                       "experts_implementation": "eager", "labels": LABELS},
            "model": {"params": sizes["params"], "expert_params": sizes["expert_params"],
                      "param_bytes": 4 * sizes["params"], "expert_param_bytes": 4 * sizes["expert_params"]},
            "ratios": ratios,
            "step_time": {"median_s": step, "tokens_per_s": tps, "per_block_s": r0["step_s"],
                          "rounds": r0["rounds"], "phases_ms_rank0": r0["phases_ms"], "build_s_rank0": r0["build_s"],
                          "spawn_s": time_spawn_s},
            "param_bytes": params,
            "all_to_all": a2a,
            "memory": mem,
            "losses": r0["losses"], "loss_rel_diff_ep_vs_dp": loss_diff, "loss_rtol": args.loss_rtol,
            "losses_ok": losses_ok, "all_to_all_exact": a2a["exact_every_step"],
            "loadavg_before": load_before, "loadavg_after": _common.loadavg(), "seconds": elapsed}
    return data


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nprocs", type=int, nargs="+", default=[2, 4], help="rank counts, each run in turn")
    p.add_argument("--model", choices=["deepseek_v3", "mixtral"], default="deepseek_v3")
    p.add_argument("--n-group", type=int, default=4, help="deepseek_v3: expert groups")
    p.add_argument("--topk-group", type=int, default=2, help="deepseek_v3: groups a token's experts come from")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=512)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="sequences a step (the global batch)")
    p.add_argument("--lr", type=float, default=1e-3)
    _rss.add_protocol_args(p, warmup=2, rounds=10, block=2)
    p.add_argument("--parts", nargs="*", default=["time", "memory"], choices=["time", "memory"],
                   help="1: step time, parameter bytes, all-to-all bytes; 2: peak RSS")
    p.add_argument("--out", default=str(_common.RESULTS_DIR / "moe.json"))
    args = _common.parse_args(p, {"hidden": 64, "intermediate": 96, "layers": 2, "heads": 4, "kv_heads": 2,
                                  "experts": 4, "vocab": 128, "seq": 16, "batch": 4, "warmup": 1, "rounds": 1,
                                  "block": 1, "mem_steps": 1, "nprocs": [2], "n_group": 2, "topk_group": 1},
                              "moe.json")
    if "time" not in args.parts:
        p.error("--parts needs 'time' (the parameter and all-to-all figures come from it)")
    for n in args.nprocs:
        if args.batch % n or args.experts % n:
            p.error(f"--batch ({args.batch}) and --experts ({args.experts}) must be multiples of every --nprocs ({n})")
    runs = {str(n): _run(args, n) for n in args.nprocs}
    first = runs[str(args.nprocs[0])]
    data = {**first, "by_nproc": runs}  # the first size's figures at the top level, every size's under by_nproc
    _common.save_results(args.out, data)


if __name__ == "__main__":
    main()
