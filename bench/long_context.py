"""Long context: nnscaler's `cp` policy (ring attention) on N ranks against one process, on a tiny Llama.

    python bench/long_context.py [--nproc 2] [--lengths 4096 8192 16384] [--budget-at 8192] [--budget-probes 1]
    python bench/long_context.py --nproc 2 4 --budget-probes 0 --census-at 4096 8192

`--nproc 2 4`: both cp sizes in one run against the same one-process runs (cp 1); the first size
writes `--out` (bench/results/long_context.json), each other n the same name with `_cp<n>`
(bench/results/long_context_cp4.json).

The model is transformers' `LlamaForCausalLM` built from a config in code (nothing downloaded;
seed-0 weights, float32, `attn_implementation="sdpa"`: one `scaled_dot_product_attention` per
layer, causal, no mask), `--layers` (2) layers of `--hidden` (128), `--heads` (4) query heads of
`--head-dim` (32) and `--kv-heads` (2) key/value heads (grouped-query attention), SwiGLU MLP of
`--intermediate` (512), vocabulary `--vocab` (32,000: LlamaConfig's default; the logits, (T, V)
float32, are then the largest activation, as in real models), untied head, no dropout (8.7 M
parameters); trained with transformers' own loss (`--loss hf`: forward(input_ids, labels) returns
`model(input_ids=..., labels=...).loss`, ForCausalLMLoss: labels shifted, mean in float32), or
`--loss wrapper`: `F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1))` on the logits.
Batch: one sequence of T random tokens and T random labels a step (step s: generator seed
1000 + s). Adam (lr 1e-3). Two cases, the same wrapper, weights and batches:

* `one`: the reference: plain PyTorch (the module itself, `torch.optim.Adam`) in one process with
         `cores` (2) intra-op threads (a gloo group of 1 exists, unused but for the baseline's
         warm-up, as in the other case);
* `cp` : `parallelize(model, sample, "cp", ComputeConfig(n, n))` + `build_optimizer(pm, Adam)` on
         `--nproc` (2) gloo processes with `cores // n` (1) thread each: every op split along the
         sequence, each attention ring attention (nnscaler.runtime.ring_attention: K/V blocks
         around the ring, the fused CPU kernel per block, the causal rows in the zigzag layout).
         Every rank passes the whole batch; the generated code takes its rows. The module is traced
         on a `--trace-seq` (512)-token sample: the generated code reads every size from the
         tensors it gets (ComputeConfig's constant_folding=False, docs/tracing.md), so one program
         runs every length and the build holds no full-length trace (`--trace-seq 0` traces at the
         run's length: rank 0 then runs the whole forward in the build and keeps the traced values,
         2.7 GiB at 8K here, more than the one-process training peak; that is the build's peak, not
         the step's). The loss of every step must equal the one-process loss within `--loss-rtol`
         (1e-4, relative): that checks the program at every length it runs.

**Memory** (one spawn per case and length, so each figure is its own process's): the workers run
with glibc's `MALLOC_MMAP_THRESHOLD_=65536` and `MALLOC_TRIM_THRESHOLD_=131072` (set before the
spawn; glibc reads them at start; `--no-malloc-env` drops them): every allocation above 64 KiB is
its own mapping, unmapped when freed, so RSS follows the live tensors and freed memory counts as
freed. The protocol is bench/_rss.py's (as fsdp.py and moe.py): each rank records its RSS after
one Adam step of a 2-layer, 64-token copy of the model, a ring send / receive, an all-reduce and an
all-to-all, released (`baseline`: torch, transformers, nnscaler, gloo, code pages, thread pools),
builds (model, parallelize, optimizer), runs `--mem-warmup` (1) step of `--warmup-seq` (512)
tokens (gradients and Adam state then exist; their size does not depend on T, and a full-length
warm-up gave the same peaks within 0.2 MiB at 4K: `--warmup-seq 0`), `gc.collect()` +
`malloc_trim(0)`, resets its peak RSS (VmHWM := VmRSS) and runs `--mem-steps` (1) steps of T
tokens; the **steady-state peak RSS** is VmHWM after them (at least the largest VmRSS sampled every
2 ms). Reported per rank (a case's figure: its larger rank): the peak RSS, the peak above the
baseline, `steady` (RSS at the reset: what is held between steps: weights, gradients and Adam
state, replicated under cp) and the peak above it (`transient`: activations, gradients in flight,
communication buffers), the build's peak (build and warm-up, before the reset), the step time of
the measured steps (the slower rank's; with the malloc settings above, which fault every large
allocation's pages in anew, for both cases; other jobs on the machine move it: the load average is
recorded) and tokens/s = T / step time. Ratios cp / one at every length; target: peak RSS per rank
at cp 2 <= 0.55 x one process at 8K and above, checked on the peak RSS and on the peak above the
baseline. Both figures are also fitted against T over the grid (least squares: fixed bytes +
bytes per token, per case): the per-token ratio is what the ratio tends to at long sequences, and
the fit says from which length it would be under the target.

**Why not less** (`--census-at`, default the budget length): after the measured steps each rank
runs one more forward under `torch.autograd.graph.saved_tensors_hooks` and records every distinct
storage saved for backward (parameters excluded): bytes by kind (a dim of the full length T:
whole-sequence tensors; of T / n: this rank's rows; neither) and the largest of each kind. From the
cp build: the plan report's first lines and unannotated ops, and the generated code's all-gathers
(what is made whole) with their source lines.

**Budget**: the longest sequence whose steady-state peak RSS fits a per-process budget, with and
without cp; the budget is the one-process peak at `--budget-at` (8192; or `--budget-mib`). From the
grid, each case's longest fitting length and shortest failing one; then up to `--budget-probes`
(1) more runs per case at a length on a `--budget-step` (512) grid, each measured as above (all
ranks stop after a step over the budget): the length the affine fit of peak RSS against T (over
the case's runs) predicts, or, when that is not inside the bracket, the next step above the
longest fitting length. Reported: the longest length that fitted, the shortest that did not, the
fit's estimate. The build is outside the budget (its peak is reported).

**Ring attention on gloo and the failure protocol.** nnscaler's failure protocol waits for
collectives in 0.25 s slices (`work.wait(timeout)`); on gloo, a timed wait on send / receive work
that times out closes every connection of the process ("Application timeout caused pair
closure"), so with a runtime that waits for the ring's isend / irecv that way, a rank more than a
slice late to a block exchange (a loaded machine, a long block) ends the step
("CollectiveTimeoutError ... timed out after 1 s": seen here at 8K). `--failure-protocol auto`
(default) keeps the protocol on where the runtime waits for gloo's send / receive work on a helper
thread instead (its failures/backends.py has `timed_wait_breaks`), else turns it off in the cp
workers (`nnscaler.runtime.failures.enabled = False`: plain waits); the results say which.

`--smoke`: 64 and 128 tokens, a 2-layer model of 32, one probe, each case's lengths in one process
(`--same-process`); results to a temporary directory. Writes bench/results/long_context.json.
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Dict, List, Optional

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402
import _rss  # noqa: E402
from _common import MIB, fmt_mib as _mib  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _causal_lm import CausalLMLoss, HFCausalLMLoss  # noqa: E402

CASES = ("one", "cp")
TARGETS = {2: 0.55, 4: 0.30}  # per-rank memory cp / one (issue 44): at 4K and 8K tokens
TARGET_FROM = 4096


def _labels(n: int, cores: int) -> Dict[str, str]:
    return {"one": f"one process, plain PyTorch + torch.optim.Adam, {cores} threads",
            "cp": f"nnscaler cp: parallelize(..., 'cp', ComputeConfig({n}, {n})), {n} gloo ranks x "
                  f"{_common.threads_per_rank(n)} thread(s)"}


# -- the model --------------------------------------------------------------------------------------

def _llama(a: dict, seq: int, seed: int = 0, layers: Optional[int] = None) -> CausalLMLoss:
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=a["vocab"], hidden_size=a["hidden"], intermediate_size=a["intermediate"],
                      num_hidden_layers=layers or a["layers"], num_attention_heads=a["heads"],
                      num_key_value_heads=a["kv_heads"], head_dim=a["head_dim"], max_position_embeddings=seq,
                      attention_dropout=0.0, attn_implementation="sdpa", use_cache=False,
                      tie_word_embeddings=False)
    torch.manual_seed(seed)
    wrap = HFCausalLMLoss if a.get("loss", "hf") == "hf" else CausalLMLoss
    return wrap(LlamaForCausalLM(cfg)).float().train()


def _batch(a: dict, seq: int, step: int) -> dict:
    """Step `step`'s batch: one sequence of `seq` random tokens and random labels (seed 1000 + step)."""
    g = torch.Generator().manual_seed(1000 + step)
    return {"input_ids": torch.randint(0, a["vocab"], (1, seq), generator=g),
            "labels": torch.randint(0, a["vocab"], (1, seq), generator=g)}


def _step(model, opt, b: dict) -> torch.Tensor:
    opt.zero_grad()
    loss = model(**b)
    loss.backward()
    opt.step()
    return loss.detach()


def _tiny_step(a: dict) -> None:
    """One Adam step of a 2-layer, 64-token copy of the model (plain PyTorch), dropped after; then
    one ring send / receive of 4096 float32 (what ring attention runs besides the all-to-all)."""
    m = _llama(a, 64, seed=1, layers=2)
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    _step(m, opt, _batch(a, 64, 0))
    del m, opt
    n, r = dist.get_world_size(), dist.get_rank()
    if n > 1:
        x, y = torch.ones(4096), torch.empty(4096)
        ops = [dist.P2POp(dist.isend, x, (r + 1) % n), dist.P2POp(dist.irecv, y, (r - 1) % n)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()


def _p2p_safe_waits() -> bool:
    """Whether nnscaler's failure protocol waits for gloo's send / receive work without a timed
    `work.wait` (which closes gloo's connections when it times out): its backends table says so."""
    try:
        from nnscaler.runtime.failures import backends
    except ImportError:
        return False
    return hasattr(backends, "timed_wait_breaks")


def _build(case: str, a: dict, seq: int, gen_dir: str):
    """(module, optimizer, parameter count, the warnings parallelize gave: first lines)."""
    base = _llama(a, seq)
    n_params = sum(p.numel() for p in base.parameters())
    if case == "one":
        return base, torch.optim.Adam(base.parameters(), lr=a["lr"]), n_params, []
    from nnscaler import ComputeConfig, build_optimizer, parallelize
    from nnscaler.runtime import failures
    failures.enabled = a["failure_protocol"] == "on"  # see the module docstring (gloo p2p and timed waits)
    world = dist.get_world_size()
    trace_seq = a["trace_seq"] or seq
    cc = ComputeConfig(world, world, trace_strategy="cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm = parallelize(base, _batch(a, trace_seq, 0), "cp", cc, gen_savedir=gen_dir,
                         instance_name=f"lc_t{trace_seq}", reuse="override")
    pm.train()
    opt = build_optimizer(pm, torch.optim.Adam, lr=a["lr"])
    del base
    return pm, opt, n_params, sorted({f"{w.category.__name__}: {str(w.message).splitlines()[0]}" for w in caught})


def _census(model, b: dict, seq: int, world: int) -> dict:
    """One forward under saved_tensors_hooks: the distinct storages saved for backward (parameters
    excluded), by kind: a dim of `seq` (whole sequence), of `seq // world` (this rank's rows; under
    one process the same as whole), neither. Then the graph is dropped (no backward)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: Dict[int, tuple] = {}

    def pack(t):
        if isinstance(t, torch.Tensor) and t.device.type == "cpu":
            s = t.untyped_storage()
            if s.data_ptr() not in params and s.nbytes():
                seen.setdefault(s.data_ptr(), (s.nbytes(), tuple(t.shape), str(t.dtype).replace("torch.", "")))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(**b)
    del loss
    local = seq // world
    kinds = {"whole_sequence": 0, "local_rows": 0, "other": 0}
    shapes: Dict[str, Dict[tuple, List[int]]] = {k: {} for k in kinds}
    symbolic: Dict[str, List[int]] = {}
    for nbytes, shape, dtype in seen.values():
        kind = "whole_sequence" if world > 1 and seq in shape else "local_rows" if local in shape else "other"
        kinds[kind] += nbytes
        w = shapes[kind].setdefault((shape, dtype), [0, 0])
        w[0] += 1
        w[1] += nbytes
        key = "(" + ", ".join("T" if d == seq and world > 1 else "L" if d == local else str(d) for d in shape) + \
            f") {dtype}"
        w = symbolic.setdefault(key, [0, 0])
        w[0] += 1
        w[1] += nbytes
    top = {k: [{"shape": list(s), "dtype": d, "count": c, "bytes": n}
               for (s, d), (c, n) in sorted(v.items(), key=lambda kv: -kv[1][1])[:8]] for k, v in shapes.items()}
    return {"saved_bytes": sum(kinds.values()), "by_kind": kinds, "tensors": len(seen),
            "whole_sequence_tensors": top["whole_sequence"], "largest": top,
            "by_shape": {k: {"count": c, "bytes": n}
                         for k, (c, n) in sorted(symbolic.items(), key=lambda kv: -kv[1][1])}}


def _census_excess(one: dict, cp: dict, n: int) -> List[dict]:
    """Per symbolic shape (L: a rank's rows, T / n under cp and T in one process; T: the whole
    sequence), what a cp rank saves for backward beyond 1 / n of what one process saves."""
    keys = set(one["by_shape"]) | set(cp["by_shape"])
    rows = []
    for k in keys:
        o, c = one["by_shape"].get(k, {"count": 0, "bytes": 0}), cp["by_shape"].get(k, {"count": 0, "bytes": 0})
        rows.append({"shape": k, "one_count": o["count"], "one_bytes": o["bytes"], "cp_count": c["count"],
                     "cp_bytes": c["bytes"], "cp_minus_one_over_n": c["bytes"] - o["bytes"] / n})
    return sorted(rows, key=lambda r: -abs(r["cp_minus_one_over_n"]))


def _measure(case: str, a: dict, seq: int, gen_dir: str, budget: int, census: bool) -> dict:
    """Build, `mem_warmup` steps, then `_rss.steady_state_peak` over `mem_steps` steps (each rank
    passes the whole batch: under cp the generated code takes its rows), the census if asked, drop
    the model. With `budget` (bytes) all ranks stop after the first measured step whose peak RSS is
    over it on some rank. Step times: the slower rank's."""
    world = dist.get_world_size()
    _rss.release()
    before = _rss.status("VmRSS")
    t0 = time.perf_counter()
    model, opt, n_params, notes = _build(case, a, seq, gen_dir)
    build_s = time.perf_counter() - t0
    nsteps = a["mem_warmup"] + a["mem_steps"]

    def step(b):
        return _step(model, opt, b).item()

    warm_s, losses = [], []
    for s in range(a["mem_warmup"]):
        b = _batch(a, a["warmup_seq"] or seq, s)
        t = time.perf_counter()
        losses.append(step(b))
        warm_s.append(time.perf_counter() - t)
    _rss.release()
    build_peak = _rss.status("VmHWM")
    held = _rss.held_bytes(model, opt)
    dist.barrier()
    m = _rss.steady_state_peak(step, (_batch(a, seq, s) for s in range(a["mem_warmup"], nsteps)), budget)
    losses += m.losses
    step_s = _common.all_reduce_floats(warm_s + m.step_s, dist.ReduceOp.MAX)  # the slower rank's
    spread = [hi - lo for hi, lo in zip(_common.all_reduce_floats(losses, dist.ReduceOp.MAX),
                                        _common.all_reduce_floats(losses, dist.ReduceOp.MIN))]
    saved = _census(model, _batch(a, seq, nsteps), seq, world) if census and m.over_budget_at_step is None else None
    del model, opt
    _rss.release()
    dist.barrier()
    return {"case": case, "seq": seq, "params": n_params, "threads": torch.get_num_threads(),
            "rss_before_build": before, "build_peak": build_peak, "build_s": build_s, "held_bytes": held,
            "steady_rss": m.steady, "peak_rss": m.peak, "sampled_peak_rss": m.sampled, "peak_rss_per_step": m.per_step,
            "transient": m.peak - m.steady, "warmup_step_s": step_s[:len(warm_s)], "step_s": step_s[len(warm_s):],
            "losses": losses, "loss_spread_over_ranks": max(spread, default=0.0),
            "over_budget_at_step": m.over_budget_at_step, "saved_for_backward": saved, "build_notes": notes}


def run_lengths(rank: int, case: str, a: dict, seqs: list, gen_dir: str, budget: int, census_at: list) -> list:
    """This process's baseline (`_rss.baselines`: after `_tiny_step` and an all-reduce and an
    all-to-all), then `_measure` at each length of `seqs` in turn (one, unless --same-process); the
    peaks above that baseline."""
    cold, baseline = _rss.baselines(lambda: _tiny_step(a), ("all_reduce", "all_to_all"))
    out = []
    for seq in seqs:
        r = _measure(case, a, seq, gen_dir, budget, seq in census_at)
        r.update(rank=rank, baseline_cold_rss=cold, baseline_rss=baseline, peak_above_baseline=r["peak_rss"] - baseline,
                 steady_above_baseline=r["steady_rss"] - baseline, position_in_process=len(out))
        out.append(r)
    return out


# -- driver ---------------------------------------------------------------------------------------

def _summary(case: str, label: str, ranks: list, spawn_s: float) -> dict:
    """`_rss.mem_summary` (each figure the maximum over the ranks) plus this bench's keys."""
    r0 = ranks[0]
    out = _rss.mem_summary(case, label, ranks, spawn_s, rank0_keys=("seq", "params", "over_budget_at_step",
                                                                   "build_notes", "warmup_step_s"))
    step = out["step_s_median"]
    out.update(nproc=len(ranks), steady_above_baseline=max(r["steady_above_baseline"] for r in ranks),
               rss_before_build=max(r["rss_before_build"] for r in ranks), step_s=step,
               tokens_per_s=r0["seq"] / step if step else None,
               loss_spread_over_ranks=max(r["loss_spread_over_ranks"] for r in ranks), fits=None)
    return out


def _run(case: str, seqs: List[int], a: dict, tmp: str, budget: int = 0, census_at=()) -> List[dict]:
    """`run_lengths` over `seqs` in one spawn (nproc ranks for cp, 1 for one): each length's summary."""
    n = a["nproc"] if case == "cp" else 1
    gen = os.path.join(tmp, f"gen_{case}_{seqs[0]}")
    ranks, s = _rss.spawn(run_lengths, (case, a, list(seqs), gen, budget, list(census_at)), n,
                          os.path.join(tmp, f"{case}_{seqs[0]}.json"), a["malloc_env"])
    out = []
    for i in range(len(seqs)):
        r = _summary(case, a["labels"][case], [rr[i] for rr in ranks], s)
        r["gen_dir"] = gen if case == "cp" else None
        out.append(r)
    return out


def _plan_facts(gen_dir: str) -> dict:
    """From a cp build's gen_savedir: the plan report's summary and unannotated ops, and the generated
    code's ring attention calls, all-gathers and all-to-alls (with the source line above each)."""
    facts = {"plan_report": None, "ring_attention_calls": None, "grad_all_reduce_calls": None, "split_calls": None,
             "all_gathers": [], "unannotated_ops": []}
    reports = glob.glob(os.path.join(gen_dir, "**", "plan_report.txt"), recursive=True)
    if reports:
        text = Path(reports[0]).read_text()
        lines = text.splitlines()
        facts["plan_report"] = [ln.rstrip() for ln in lines[:8]]
        if "ops without a dimension annotation" in text:
            start = next(i for i, ln in enumerate(lines) if "ops without a dimension annotation" in ln)
            facts["unannotated_ops"] = [ln.strip() for ln in lines[start + 1:] if ln.startswith("    ")]
    code = sorted(glob.glob(os.path.join(gen_dir, "**", "gencode0.py"), recursive=True))
    if code:
        lines = Path(code[0]).read_text().splitlines()
        facts["ring_attention_calls"] = sum("nr.ring_attention.attention(" in ln for ln in lines)
        # a replicated weight enters each op through grad_all_reduce (forward: the parameter as a view; backward: the
        # all-reduce of its partial gradient); split: a whole tensor cut to this rank's rows
        facts["grad_all_reduce_calls"] = sum("nr.comm.grad_all_reduce(" in ln for ln in lines)
        facts["split_calls"] = sum("nr.comm.split(" in ln for ln in lines)
        where = None
        for ln in lines:
            s = ln.strip()
            if s.startswith("# ") and " in " in s:
                where = s[2:]
            m = re.match(r"(\w+) = nr\.comm\.(all_gather|all_to_all|all_reduce)\((\w+)", s)
            if m:
                facts["all_gathers"].append({"out": m.group(1), "collective": m.group(2), "of": m.group(3),
                                             "source": where})
    return facts


def _fit(points: List[tuple]) -> Optional[tuple]:
    """Least-squares (intercept, slope) of peak RSS against T over (T, peak) points (>= 2 lengths)."""
    xs = [float(t) for t, _ in points]
    if len(set(xs)) < 2:
        return None
    ys = [float(p) for _, p in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def _bracket(runs: List[dict], budget: int) -> tuple:
    fits = sorted(r["seq"] for r in runs if r["fits"])
    fails = sorted(r["seq"] for r in runs if not r["fits"])
    lo = fits[-1] if fits else None
    hi = next((t for t in fails if lo is None or t > lo), None)
    return lo, hi


def _budget_search(case: str, runs: List[dict], budget: int, a: dict, tmp: str, probes: int, step: int) -> dict:
    """The longest length whose peak RSS fits `budget`: the bracket from `runs`, narrowed by probes."""
    runs = list(runs)
    probe_runs = []
    for r in runs:
        r["fits"] = r["peak_rss"] <= budget
    estimate = None
    for _ in range(probes):
        lo, hi = _bracket(runs, budget)
        fit = _fit([(r["seq"], r["peak_rss"]) for r in runs])
        estimate = None if fit is None or fit[1] <= 0 else (budget - fit[0]) / fit[1]
        if lo is not None and hi is not None and hi - lo <= step:
            break
        if lo is None:
            break  # even the shortest measured length does not fit: nothing to narrow
        cand = int(estimate // step * step) if estimate is not None else lo + step
        if cand <= lo:
            cand = lo + step
        if hi is not None and cand >= hi:
            cand = hi - step
        if cand % (2 * a["nproc"]):
            cand -= cand % (2 * a["nproc"])
        if cand <= lo:
            break
        print(f"  budget probe {case} at {cand} tokens (bracket {lo}..{hi}, fit estimate "
              f"{'-' if estimate is None else f'{estimate:,.0f}'})", flush=True)
        r = _run(case, [cand], a, tmp, budget=budget)[0]
        r["fits"] = r["peak_rss"] <= budget and r["over_budget_at_step"] is None
        print(f"    peak RSS {_mib(r['peak_rss'])} MiB: {'fits' if r['fits'] else 'over'} ({r['spawn_s']:.0f} s)",
              flush=True)
        runs.append(r)
        probe_runs.append(r)
    lo, hi = _bracket(runs, budget)
    fit = _fit([(r["seq"], r["peak_rss"]) for r in runs])
    estimate = None if fit is None or fit[1] <= 0 else (budget - fit[0]) / fit[1]
    return {"longest_fitting": lo, "shortest_not_fitting": hi,
            "resolved_to_step": lo is not None and hi is not None and hi - lo <= step, "fit_estimate_tokens": estimate,
            "fit_intercept_bytes": None if fit is None else fit[0],
            "fit_bytes_per_token": None if fit is None else fit[1],
            "points": [{"seq": r["seq"], "peak_rss": r["peak_rss"], "fits": r["fits"]}
                       for r in sorted(runs, key=lambda r: r["seq"])],
            "probes": [{k: r[k] for k in ("seq", "peak_rss", "peak_above_baseline", "fits", "over_budget_at_step",
                                          "step_s", "losses", "spawn_s")} for r in probe_runs]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384])
    p.add_argument("--nproc", type=int, nargs="+", default=[2],
                   help="the cp sizes (ranks of the cp case): several in one run share the one-process runs; "
                        "the first writes --out, each other n writes --out with the suffix _cp<n>")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--intermediate", type=int, default=512)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--loss", choices=["hf", "wrapper"], default="hf",
                   help="hf: the model's own loss (labels=); wrapper: F.cross_entropy on the logits")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--trace-seq", type=int, default=512, help="tokens of the sample cp traces (0: the run's length)")
    p.add_argument("--mem-warmup", type=int, default=1)
    p.add_argument("--warmup-seq", type=int, default=512,
                   help="tokens of the warm-up steps (0: the run's length): gradients and Adam state exist after one")
    p.add_argument("--mem-steps", type=int, default=1)
    p.add_argument("--loss-rtol", type=float, default=1e-4)
    p.add_argument("--budget-at", type=int, default=8192, help="the budget: one process's peak RSS at this length")
    p.add_argument("--budget-mib", type=float, default=None, help="a fixed budget instead (MiB)")
    p.add_argument("--budget-probes", type=int, default=1, help="extra runs per case to narrow the longest length")
    p.add_argument("--budget-step", type=int, default=512)
    p.add_argument("--census-at", type=int, nargs="*", default=None,
                   help="lengths at which the tensors saved for backward are counted (default: --budget-at)")
    p.add_argument("--failure-protocol", choices=["auto", "on", "off"], default="auto",
                   help="nnscaler's failure protocol in the cp workers; auto: on where its waits keep gloo's "
                        "send / receive off timed waits, else off (docstring)")
    p.add_argument("--same-process", action="store_true",
                   help="each case's lengths one after the other in one spawn (the smoke run's way: fewer spawns)")
    p.add_argument("--no-malloc-env", action="store_true", help="glibc's malloc defaults in the workers")
    p.add_argument("--out", default=str(_common.RESULTS_DIR / "long_context.json"))
    args = _common.parse_args(p, {"lengths": [64, 128], "hidden": 32, "intermediate": 64, "layers": 2,
                                  "head_dim": 8, "vocab": 64, "trace_seq": 32, "warmup_seq": 32, "budget_at": 64,
                                  "budget_probes": 1, "budget_step": 16,
                                  "same_process": True}, "long_context.json")
    nprocs = list(dict.fromkeys(args.nproc))
    lengths = sorted(set(args.lengths))
    for n in nprocs:
        bad = [t for t in lengths + [args.trace_seq or lengths[0], args.warmup_seq or lengths[0], args.budget_step]
               if t % (2 * n)]
        if bad:
            p.error(f"lengths, --trace-seq and --budget-step must be multiples of 2 x --nproc = {2 * n} "
                    f"(causal ring attention balances 2N chunks): {bad}")
    if args.budget_mib is None and args.budget_at not in lengths:
        p.error(f"--budget-at {args.budget_at} must be one of --lengths {lengths}")
    census_at = set(args.census_at if args.census_at is not None else [args.budget_at])
    cores = _common.cpu_count()
    base = {k: getattr(args, k) for k in ("vocab", "hidden", "intermediate", "layers", "heads", "kv_heads",
                                          "head_dim", "lr", "trace_seq", "warmup_seq", "mem_warmup", "mem_steps",
                                          "failure_protocol", "loss")}
    base["malloc_env"] = not args.no_malloc_env
    if args.failure_protocol == "auto":
        base["failure_protocol"] = "on" if _p2p_safe_waits() else "off"
    per_n = {n: {**base, "nproc": n, "labels": _labels(n, cores)} for n in nprocs}
    t_start = time.perf_counter()
    load_before = _common.loadavg()
    print(f"Llama {args.layers} x {args.hidden} (heads {args.heads} x {args.head_dim}, kv {args.kv_heads}, MLP "
          f"{args.intermediate}, vocab {args.vocab}); lengths {lengths}; {per_n[nprocs[0]]['labels']['one']} vs "
          + ", ".join(per_n[n]["labels"]["cp"] for n in nprocs), flush=True)
    one_runs: Dict[int, dict] = {}
    cp_runs: Dict[int, Dict[int, dict]] = {n: {} for n in nprocs}
    facts: Dict[int, Optional[dict]] = {n: None for n in nprocs}
    with tempfile.TemporaryDirectory() as tmp:
        groups = [lengths] if args.same_process else [[t] for t in lengths]
        for seqs in groups:
            for c, n in [("one", nprocs[0])] + [("cp", n) for n in nprocs]:
                for r in _run(c, seqs, per_n[n], tmp, census_at=census_at):
                    (one_runs if c == "one" else cp_runs[n])[r["seq"]] = r
                    name = "one" if c == "one" else f"cp{n}"
                    print(f"{name:>4} {r['seq']:>6} tokens: peak RSS {_mib(r['peak_rss'])} MiB (above baseline "
                          f"{_mib(r['peak_above_baseline'])}), step {r['step_s']:.2f} s (spawn {r['spawn_s']:.0f} s)",
                          flush=True)
                    if c == "cp" and facts[n] is None:
                        facts[n] = _plan_facts(r["gen_dir"])
        budget = int(args.budget_mib * MIB) if args.budget_mib is not None else one_runs[args.budget_at]["peak_rss"]
        print(f"budget: {_mib(budget)} MiB per process", flush=True)
        one_search = _budget_search("one", list(one_runs.values()), budget, per_n[nprocs[0]], tmp,
                                    args.budget_probes, args.budget_step)
        searches = {n: {"one": one_search, "cp": _budget_search("cp", list(cp_runs[n].values()), budget, per_n[n], tmp,
                                                                args.budget_probes, args.budget_step)}
                    for n in nprocs}
    for i, n in enumerate(nprocs):
        out = args.out if i == 0 else _suffixed(args.out, n)
        _report(args, n, per_n[n], {"one": one_runs, "cp": cp_runs[n]}, searches[n], facts[n], budget, census_at,
                lengths, cores, t_start, load_before, out, nprocs)


def _suffixed(out: str, n: int) -> str:
    """`out` with ``_cp<n>`` before its suffix (long_context.json -> long_context_cp4.json)."""
    path = Path(out)
    return str(path.with_name(f"{path.stem}_cp{n}{path.suffix}"))


def _report(args, n: int, a: dict, runs: Dict[str, Dict[int, dict]], search: dict, facts: Optional[dict], budget: int,
            census_at: set, lengths: List[int], cores: int, t_start: float, load_before, out: str,
            nprocs: List[int]) -> None:
    """Print cp `n`'s table, target, fits, census, plan and budget against the one process; write `out`."""
    labels = a["labels"]
    print(f"\n==== cp {n} ====")

    # -- report ------------------------------------------------------------------------------------
    rows, per_length, loss_diffs = [], {}, {}
    for seq in lengths:
        o, c = runs["one"][seq], runs["cp"][seq]
        diff = _common.max_rel_diff(c["losses"], o["losses"])
        loss_diffs[seq] = diff
        ratios = {"peak_rss": c["peak_rss"] / o["peak_rss"],
                  "peak_above_baseline": c["peak_above_baseline"] / o["peak_above_baseline"],
                  "transient": c["transient"] / o["transient"],
                  "step_time": c["step_s"] / o["step_s"], "tokens_per_s": c["tokens_per_s"] / o["tokens_per_s"]}
        so, sc = (r.get("per_rank")[0].get("saved_for_backward") for r in (o, c))
        if so and sc:
            ratios["saved_for_backward"] = max(x["saved_for_backward"]["saved_bytes"] for x in c["per_rank"]) / \
                so["saved_bytes"]
        per_length[seq] = {"one": {k: v for k, v in o.items() if k != "gen_dir"},
                           "cp": {k: v for k, v in c.items() if k != "gen_dir"},
                           "ratios_cp_over_one": ratios, "loss_rel_diff": diff}
        for case, r in (("one", o), ("cp", c)):
            rows.append([f"{seq} {case}", _mib(r["baseline_rss"]), _mib(r["steady_rss"]), _mib(r["peak_rss"]),
                         _mib(r["peak_above_baseline"]), _mib(r["transient"]), _mib(r["build_peak"]),
                         f"{r['step_s']:.2f}", f"{r['tokens_per_s']:,.0f}",
                         f"{ratios['peak_rss']:.3f}" if case == "cp" else "",
                         f"{ratios['peak_above_baseline']:.3f}" if case == "cp" else "",
                         f"{ratios['transient']:.3f}" if case == "cp" else "",
                         f"{ratios['step_time']:.2f}" if case == "cp" else ""])
    model_params = runs["one"][lengths[0]]["params"]
    print(f"\n== Llama {args.layers} x {args.hidden}: {model_params:,} parameters, float32, Adam; per case its "
          f"larger rank; MiB ==")
    print(_common.table(["T case", "baseline", "steady", "peak RSS", "peak - baseline", "transient", "build peak",
                         "step s", "tokens/s", "peak cp/one", "above-base cp/one", "transient cp/one",
                         "time cp/one"], rows))
    losses_ok = all(d <= args.loss_rtol for d in loss_diffs.values())
    print("loss rel diff cp vs one: " + ", ".join(f"{t}: {d:.1e}" for t, d in loss_diffs.items())
          + f" ({'ok' if losses_ok else 'NOT OK'}, rtol {args.loss_rtol})")
    long = [t for t in lengths if t >= TARGET_FROM]
    TARGET = TARGETS.get(n, 1.1 / n)
    met = {key: bool(long) and all(per_length[t]["ratios_cp_over_one"][key] <= TARGET for t in long)
           for key in ("peak_rss", "peak_above_baseline", "transient")}
    target = {"target": TARGET, "from_length": TARGET_FROM, "lengths": long, "met_on_peak_rss": met["peak_rss"],
              "met_on_peak_above_baseline": met["peak_above_baseline"], "met_on_transient": met["transient"]}
    print(f"target cp {n}/one <= {TARGET} at {TARGET_FROM}+: peak RSS {'met' if met['peak_rss'] else 'MISSED'}, "
          f"peak above baseline {'met' if met['peak_above_baseline'] else 'MISSED'}, transient (activations: "
          f"peak above the steady state) {'met' if met['transient'] else 'MISSED'}")
    per_token = {}
    for key in ("peak_rss", "peak_above_baseline"):
        fits = {c: _fit([(t, runs[c][t][key]) for t in lengths]) for c in CASES}
        if None in fits.values():
            continue
        (f_one, s_one), (f_cp, s_cp) = fits["one"], fits["cp"]
        denom = TARGET * s_one - s_cp
        reach = (f_cp - TARGET * f_one) / denom if denom > 0 else None
        per_token[key] = {"one": {"fixed_bytes": f_one, "bytes_per_token": s_one},
                          "cp": {"fixed_bytes": f_cp, "bytes_per_token": s_cp},
                          "bytes_per_token_cp_over_one": s_cp / s_one,
                          "length_where_cp_over_one_reaches_target": reach if reach is None or reach > 0 else 0.0}
        print(f"{key} against T (least squares over the grid): one {_mib(f_one)} MiB + {s_one / 1024:,.1f} KiB/token, "
              f"cp {_mib(f_cp)} MiB + {s_cp / 1024:,.1f} KiB/token per rank: per token cp/one "
              f"{s_cp / s_one:.3f}; cp/one <= {TARGET} from "
              + ("never (per token above the target)" if reach is None else f"{max(reach, 0):,.0f} tokens"))
    for seq in sorted(census_at & set(lengths)):
        so = runs["one"][seq]["per_rank"][0]["saved_for_backward"]
        if not so:
            continue
        print(f"\nsaved for backward at {seq} tokens (one forward, parameters excluded): one process "
              f"{_mib(so['saved_bytes'])} MiB; cp per rank "
              + ", ".join(f"rank {r['rank']} {_mib(r['saved_for_backward']['saved_bytes'])} MiB (whole-sequence "
                          f"{_mib(r['saved_for_backward']['by_kind']['whole_sequence'])}, own rows "
                          f"{_mib(r['saved_for_backward']['by_kind']['local_rows'])}, other "
                          f"{_mib(r['saved_for_backward']['by_kind']['other'])})"
                          for r in runs["cp"][seq]["per_rank"] if r["saved_for_backward"]))
        excess = _census_excess(so, runs["cp"][seq]["per_rank"][0]["saved_for_backward"], n)
        per_length[seq]["saved_for_backward_excess_rank0"] = excess
        print(f"  rank 0 beyond 1/{n} of one process, by shape (L: a rank's rows, T: the whole sequence), "
              f"MiB: one -> cp (excess)")
        for e in excess[:8]:
            print(f"    {e['shape']:<28} {e['one_count']:>3} x = {_mib(e['one_bytes']):>6} -> {e['cp_count']:>3} x = "
                  f"{_mib(e['cp_bytes']):>6} ({_mib(e['cp_minus_one_over_n']):>5})")
    if facts:
        print("\ncp plan: " + "; ".join((facts["plan_report"] or [])[2:6]).replace("  ", " "))
        print(f"rank 0's code: {facts['ring_attention_calls']} ring attention calls (both branches of the packed-"
              f"sequence check), {facts['grad_all_reduce_calls']} grad_all_reduce (each replicated weight as a view of "
              f"itself: no copy), {facts['split_calls']} split; collectives that make tensors whole or move them:")
        for g in facts["all_gathers"]:
            if g["collective"] != "all_reduce":
                print(f"  {g['out']} = {g['collective']}({g['of']})  <- {g['source']}")
    print(f"\nbudget {_mib(budget)} MiB per process "
          + (f"(one process's peak RSS at {args.budget_at} tokens)" if args.budget_mib is None else "(--budget-mib)"))
    for c in CASES:
        s = search[c]
        est = "-" if s["fit_estimate_tokens"] is None else f"{s['fit_estimate_tokens']:,.0f}"
        per_k = "-" if s["fit_bytes_per_token"] is None else _mib(s["fit_bytes_per_token"] * 1024)
        print(f"  {c:>3}: longest fitting {s['longest_fitting']} tokens, shortest not fitting "
              f"{s['shortest_not_fitting']}; affine fit estimate {est} tokens ({per_k} MiB per 1K tokens)")
    lo_one, lo_cp = search["one"]["longest_fitting"], search["cp"]["longest_fitting"]
    budget_ratio = lo_cp / lo_one if lo_one and lo_cp else None
    if budget_ratio:
        print(f"  longest fitting cp / one: {budget_ratio:.2f}")
    elapsed = time.perf_counter() - t_start
    print(f"\ntotal {elapsed:.0f} s; load average before {load_before}, after {_common.loadavg()}")
    data = {**_common.run_header(),
            "config": {**vars(args), "nproc": n, "nprocs_in_this_run": nprocs, "out": out, "lengths": lengths,
                       "cores": cores, "threads": {"one": cores,
                       "cp": _common.threads_per_rank(n)}, "labels": labels, "dtype": "float32",
                       "malloc_env": None if args.no_malloc_env else _rss.MALLOC_ENV, "batch": 1,
                       "failure_protocol_used": a["failure_protocol"],
                       "census_at": sorted(census_at)},
            "model": {"params": model_params, "param_bytes": 4 * model_params},
            "target": target,
            "ratios_cp_over_one": {t: per_length[t]["ratios_cp_over_one"] for t in lengths},
            "against_length": per_token,
            "lengths": per_length,
            "losses_ok": losses_ok, "loss_rel_diff": loss_diffs, "loss_rtol": args.loss_rtol,
            "budget": {"bytes": budget, "mib": budget / MIB, "from": None if args.budget_mib is not None
                       else f"one process's peak RSS at {args.budget_at} tokens",
                       "measure": "steady-state peak RSS per process (the build outside)",
                       "one": search["one"], "cp": search["cp"], "longest_fitting_cp_over_one": budget_ratio},
            "cp_plan": facts,
            "loadavg_before": load_before, "loadavg_after": _common.loadavg(), "seconds": elapsed}
    _common.save_results(out, data)


if __name__ == "__main__":
    main()
