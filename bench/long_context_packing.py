"""Long context: packed against padded batches of documents, one process and `cp`, tokens per second.

    python bench/long_context_packing.py [--nproc 2] [--tokens 4096] [--steps 2]

The same documents (lengths drawn uniformly in [T/16, T/4] until they fill `--tokens` T; seed 0)
trained two ways with transformers' own loss on bench/long_context.py's Llama (its `_llama`, the
same options):

* packed: one sequence of T tokens holding every document, ``position_ids`` restarting at 0 per
  document (transformers attends within each; under cp ring attention reads the mask as key
  intervals: rows balanced, blocks no row sees skipped), labels -100 at each document's first token;
* padded: one row per document, right-padded to the longest (a multiple of 2 x cp), with
  ``attention_mask`` and labels -100 on the padding.

Each layout under one process (plain PyTorch, every core) and under `cp` (``--nproc`` gloo ranks,
each a build of its own: the two layouts take different inputs). Reported per case: the step time
(median of `--steps` after one warm-up step; the slower rank's), tokens/s = real tokens (T, no
padding) / step time, and the balance of ring attention's work over the ranks (its (query, key)
pairs computed, `ring_attention.WORK`: busiest / idlest rank); losses of cp and one process equal
within 1e-4 relative. Writes
bench/results/long_context_packing.json.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402
import long_context as lc  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def _lengths(tokens: int, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    lo, hi = max(1, tokens // 16), max(1, tokens // 4)
    out, left = [], tokens
    while left > 0:
        d = min(left, int(torch.randint(lo, hi + 1, (1,), generator=g)))
        out.append(d)
        left -= d
    return out


def batches(a: dict, tokens: int, n: int) -> dict:
    """{"packed": ..., "padded": ...} of the same documents."""
    docs = _lengths(tokens)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, a["vocab"], (tokens,), generator=g)
    pos = torch.cat([torch.arange(d) for d in docs])
    packed = {"input_ids": ids[None], "labels": ids.masked_fill(pos == 0, -100)[None], "position_ids": pos[None]}
    width = -(-max(docs) // (2 * n)) * (2 * n)
    rows, mask = torch.zeros(len(docs), width, dtype=torch.long), torch.zeros(len(docs), width, dtype=torch.long)
    start = 0
    for i, d in enumerate(docs):
        rows[i, :d], mask[i, :d] = ids[start:start + d], 1
        start += d
    padded = {"input_ids": rows, "labels": rows.masked_fill(mask == 0, -100), "attention_mask": mask}
    return {"packed": packed, "padded": padded, "documents": docs, "padded_width": width}


def _model(a: dict, layout: str, b: dict, n: int, gen: str):
    base = lc._llama(a, max(b["input_ids"].shape[-1], 64))
    if n == 1:
        return base, torch.optim.Adam(base.parameters(), lr=a["lr"])
    from nnscaler import ComputeConfig, build_optimizer, parallelize
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = parallelize(base, b, "cp", ComputeConfig(n, n, trace_strategy="cpu"), gen_savedir=gen,
                         instance_name=f"packing_{layout}", reuse="override")
    return pm, build_optimizer(pm, torch.optim.Adam, lr=a["lr"])


def run(rank: int, a: dict, tokens: int, steps: int, gen: str) -> dict:
    n = dist.get_world_size()
    data = batches(a, tokens, n)
    out = {"documents": data["documents"], "padded_width": data["padded_width"]}
    for layout in ("packed", "padded"):
        b = data[layout]
        model, opt = _model(a, layout, b, n, gen)
        from nnscaler.runtime import ring_attention
        ring_attention.WORK.update(calls=0, blocks=0, pairs=0)
        times, losses = [], []
        for s in range(steps + 1):
            t = time.perf_counter()
            opt.zero_grad()
            loss = model(**b)
            loss.backward()
            opt.step()
            times.append(time.perf_counter() - t)
            losses.append(loss.item())
        slow = _common.all_reduce_floats(times[1:], dist.ReduceOp.MAX)
        step = _common.median(slow)
        work = [None] * n  # ring attention's (query, key) pairs per rank: the balance over the unit
        dist.all_gather_object(work, ring_attention.WORK["pairs"])
        out[layout] = {"step_s": slow, "step_s_median": step, "tokens_per_s": tokens / step, "losses": losses,
                       "shape": list(b["input_ids"].shape), "ring_pairs_per_rank": work}
        del model, opt
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--steps", type=int, default=2)
    for name, default in (("hidden", 128), ("intermediate", 512), ("layers", 2), ("heads", 4), ("kv-heads", 2),
                          ("head-dim", 32), ("vocab", 32000)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--out", default=str(_common.RESULTS_DIR / "long_context_packing.json"))
    args = _common.parse_args(p, {"tokens": 128, "hidden": 32, "intermediate": 64, "head_dim": 8, "vocab": 64,
                                  "steps": 1}, "long_context_packing.json")
    if args.tokens % (2 * args.nproc):
        p.error(f"--tokens must be a multiple of 2 x --nproc = {2 * args.nproc}")
    a = {k: getattr(args, k) for k in ("vocab", "hidden", "intermediate", "layers", "heads", "kv_heads", "head_dim",
                                       "lr")}
    a["loss"] = "hf"
    t0, load = time.perf_counter(), _common.loadavg()
    import tempfile
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for case, n in (("one", 1), ("cp", args.nproc)):
            results[case], _ = _common.spawn_gloo(run, (a, args.tokens, args.steps, os.path.join(tmp, case)), n,
                                                  os.path.join(tmp, f"{case}.json"), gather=False,
                                                  threads=_common.cpu_count() if n == 1 else None)
    rows, ok = [], True
    for layout in ("packed", "padded"):
        for case in ("one", "cp"):
            r = results[case][layout]
            w = r["ring_pairs_per_rank"]
            rows.append([layout, case, "x".join(map(str, r["shape"])), f"{r['step_s_median']:.2f}",
                         f"{r['tokens_per_s']:,.0f}", f"{max(w) / min(w):.2f}" if min(w) else "-"])
        diff = _common.max_rel_diff(results["cp"][layout]["losses"], results["one"][layout]["losses"])
        results[f"{layout}_loss_rel_diff"] = diff
        ok = ok and diff <= 1e-4
    docs = results["one"]["documents"]
    print(f"{len(docs)} documents, {args.tokens} tokens (lengths {docs}); padded to {results['one']['padded_width']}")
    print(_common.table(["layout", "case", "batch", "step s", "tokens/s", "ring work max/min rank"], rows))
    speed = {c: results[c]["packed"]["tokens_per_s"] / results[c]["padded"]["tokens_per_s"] for c in ("one", "cp")}
    print(f"packed / padded tokens/s: one {speed['one']:.2f}, cp {args.nproc} {speed['cp']:.2f}; losses cp = one: "
          f"{'ok' if ok else 'NOT OK'}; load average {load} -> {_common.loadavg()}")
    data = {**_common.run_header(), "config": {**vars(args), "cores": _common.cpu_count()}, "results": results,
            "packed_over_padded_tokens_per_s": speed, "losses_ok": ok, "seconds": time.perf_counter() - t0}
    _common.save_results(args.out, data)


if __name__ == "__main__":
    main()
