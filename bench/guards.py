"""Cost of guards (runtime/guards.py) and of both-branch decisions per training step.

    python bench/guards.py [--ranks 2 1] [--steps 100] [--block 10] [--dim 64] [--seq 32] [--batch 8]

A forward that reads a tensor's value in Python (`if (mask == 1).all():`) becomes a run-time check
in the generated code; with more than one rank (not pipelined) each check also all-reduces a
one-element flag so every rank raises together. Per world size (`--ranks`, default 2 and 1; plan
`'dp'`, ComputeConfig(1, ranks), gloo, each rank max(1, cores // ranks) threads), in the same
processes, alternating blocks of `--block` steps (zero_grad, forward, backward, SGD step; a barrier
before every block, a block's time is the slower rank's), medians over blocks:

* `guard`     : a small attention + MLP block whose forward decides `if (mask == 1).all():` (the
                other branch raises, so the decision stays one guard per forward);
* `tensor_ops`: the same model with the decision written with tensor ops
                (`torch.where((mask == 1).all(), h * 2, h * mask)`): no guard; the reference;
* `no_decision`: the same model computing `h * 2` only (what the traced branch computes);
* `branches`  : the Hugging Face mask pattern (tests/guard_models.py HFMaskAttention at
                the same size: `None if mask.sum() == mask.numel() else a boolean mask`, SDPA with
                `is_causal` or `attn_mask`), both branches generated (`_branch_N = bool(...)`);
* `branches_ref`: the same model computing the mask with tensor ops, SDPA with `attn_mask` always
                (no decision): the reference of `branches`.

Reported: ratios guard / tensor_ops, guard / no_decision, branches / branches_ref (of medians,
and the median of per-round ratios), the step-time difference guard - no_decision in us (one
guard per forward), and `check()` alone: microseconds per call with agree (the all-reduce) and
without, and a bare one-element all-reduce. Writes bench/results/guards.json.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

sys.path.insert(0, str(_common.REPO_ROOT / "tests"))  # guard_models: the HF mask toy

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from guard_models import HFMaskAttention  # noqa: E402

VARIANTS = ("guard", "tensor_ops", "no_decision", "branches", "branches_ref")


class Block(nn.Module):
    """Causal self-attention + MLP on (batch, seq, dim), then the decision on `mask`."""

    decision = "guard"

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)
        self.heads = heads

    def body(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        return h + self.fc2(F.gelu(self.fc1(h)))


class GuardBlock(Block):
    def forward(self, x, mask):
        h = self.body(x)
        if (mask == 1).all():  # one guard per forward
            h = h * 2
        else:
            raise ValueError("unmasked batches only")
        return h.sum()


class TensorOpsBlock(Block):
    def forward(self, x, mask):
        h = self.body(x)
        h = torch.where((mask == 1).all(), h * 2, h * mask)
        return h.sum()


class NoDecisionBlock(Block):
    def forward(self, x, mask):
        return (self.body(x) * 2).sum()


class HFMaskRef(HFMaskAttention):
    """HFMaskAttention with the mask always built with tensor ops and passed to SDPA (no decision)."""

    def forward(self, input_ids, attention_mask):
        b, s = input_ids.shape
        h = self.emb(input_ids)
        q, k, v = self.qkv(h).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        causal = torch.ones(s, s, dtype=torch.bool, device=h.device).tril()
        mask = causal[None, None] & attention_mask.bool()[:, None, None, :]
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=False)
        logits = self.out(a.transpose(1, 2).reshape(b, s, -1))
        keep = attention_mask.to(logits.dtype)
        return (logits.logsumexp(-1) * keep).sum() / keep.sum()


def _models(args):
    """variant -> (model, example / every step's batch)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch, args.seq, args.dim, generator=g)
    mask = torch.ones(args.batch, args.seq, args.dim)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    hf_batch = {"input_ids": ids, "attention_mask": torch.ones(args.batch, args.seq, dtype=torch.int64)}
    out = {}
    for name, cls in (("guard", GuardBlock), ("tensor_ops", TensorOpsBlock), ("no_decision", NoDecisionBlock)):
        torch.manual_seed(0)
        out[name] = (cls(args.dim, args.heads), {"x": x, "mask": mask})
    for name, cls in (("branches", HFMaskAttention), ("branches_ref", HFMaskRef)):
        torch.manual_seed(0)
        out[name] = (cls(args.dim, args.heads, args.vocab), hf_batch)
    return out


def _code_counts(gen_dir, name):
    """Guards and generated branches in the busiest generated module (one per rank) of instance
    `name`: checks that each variant holds what it claims."""
    counts = {"guards": 0, "branches": 0}
    for root, _, files in os.walk(gen_dir):
        for f in files:
            if name in root and f.endswith(".py"):
                text = open(os.path.join(root, f)).read()
                counts = {"guards": max(counts["guards"], text.count("guards.check(")),
                          "branches": max(counts["branches"], text.count("if _branch_"))}
    return counts


def _time_check(n, agree):
    from nnscaler.runtime.guards import check
    value = torch.tensor(True)
    t0 = time.perf_counter()
    for _ in range(n):
        check(value, "bool", True, at="bench", agree=agree)
    return (time.perf_counter() - t0) / n


def _time_allreduce(n):
    import torch.distributed as dist
    flag = torch.zeros(1, dtype=torch.int64)
    t0 = time.perf_counter()
    for _ in range(n):
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return (time.perf_counter() - t0) / n


def _slowest(seconds):
    import torch.distributed as dist
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def worker(rank, args, gen_dir):
    import torch.distributed as dist
    from nnscaler import ComputeConfig, build_optimizer, parallelize

    warnings.filterwarnings("ignore", message="forward reads a tensor's value")  # expected: the guards
    world = dist.get_world_size()
    runs, code = {}, {}
    for name, (model, batch) in _models(args).items():
        pm = parallelize(model, batch, "dp", ComputeConfig(1, world, trace_strategy="cpu"),
                         gen_savedir=gen_dir, instance_name=f"{name}_w{world}")
        opt = build_optimizer(pm, torch.optim.SGD, lr=1e-3)
        runs[name] = (pm, opt, batch)
        code[name] = _code_counts(gen_dir, f"{name}_w{world}")

    def step(name):
        pm, opt, batch = runs[name]
        opt.zero_grad()
        pm(**batch).backward()
        opt.step()

    for _ in range(args.warmup):
        for name in VARIANTS:
            step(name)
    times = {name: [] for name in VARIANTS}
    for r in range(max(1, args.steps // args.block)):
        order = VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]
        for name in order:
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(args.block):
                step(name)
            times[name].append(_slowest((time.perf_counter() - t0) / args.block))

    dist.barrier()
    micro = {"check_agree_us": [], "check_local_us": [], "allreduce_us": []}
    for _ in range(5):
        micro["check_agree_us"].append(_time_check(args.micro, True) * 1e6)
        micro["check_local_us"].append(_time_check(args.micro, False) * 1e6)
        micro["allreduce_us"].append(_time_allreduce(args.micro) * 1e6 if world > 1 else 0.0)
    return {"times_s": times, "code": code, "micro_us": micro}


def summarize(world, result):
    times = result["times_s"]
    med = {k: _common.median(v) for k, v in times.items()}

    def ratio(a, b):
        return {"of_medians": med[a] / med[b],
                "paired": _common.median([x / y for x, y in zip(times[a], times[b])])}
    micro = {k: _common.median(v) for k, v in result["micro_us"].items()}
    return {"world": world, "threads_per_rank": _common.threads_per_rank(world), "code": result["code"],
            "ms_per_step": {k: v * 1e3 for k, v in med.items()},
            "guard_over_tensor_ops": ratio("guard", "tensor_ops"),
            "guard_over_no_decision": ratio("guard", "no_decision"),
            "branches_over_ref": ratio("branches", "branches_ref"),
            "guard_minus_no_decision_us": (med["guard"] - med["no_decision"]) * 1e6,
            "guard_minus_tensor_ops_us": (med["guard"] - med["tensor_ops"]) * 1e6,
            "check_us": micro, "raw": result}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 1])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--block", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--micro", type=int, default=500, help="check() calls per micro-benchmark block")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8, help="per rank")
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--out", default=str(_common.RESULTS_DIR / "guards.json"))
    args = _common.parse_args(parser, {"ranks": [2, 1], "steps": 2, "block": 1, "warmup": 1, "micro": 5, "dim": 16,
                                       "seq": 8, "batch": 2}, "guards.json")
    load_before = _common.loadavg()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for world in args.ranks:
            gathered, seconds = _common.spawn_gloo(worker, (args, tmp), world, os.path.join(tmp, f"r{world}.json"),
                                                   gather=False)
            results[str(world)] = {**summarize(world, gathered), "wall_s": seconds}
    rows = []
    for world, r in results.items():
        ms = r["ms_per_step"]
        rows.append([f"{world} rank(s)", f"{ms['tensor_ops']:.3f}", f"{ms['guard']:.3f}", f"{ms['no_decision']:.3f}",
                     f"{r['guard_over_tensor_ops']['of_medians']:.3f}", f"{r['guard_minus_no_decision_us']:.0f}",
                     f"{ms['branches_ref']:.3f}", f"{ms['branches']:.3f}",
                     f"{r['branches_over_ref']['of_medians']:.3f}",
                     f"{r['check_us']['check_agree_us']:.1f}", f"{r['check_us']['check_local_us']:.1f}"])
    print(_common.table(["world", "ms tensor_ops", "ms guard", "ms no_decision", "guard/tensor_ops",
                         "guard-no_dec us", "ms branches_ref", "ms branches", "branches/ref",
                         "check() us", "check() local us"], rows))
    _common.save_results(args.out, {**_common.run_header(), "config": vars(args), "results": results,
                                    "loadavg_before": load_before, "loadavg_after": _common.loadavg()})


if __name__ == "__main__":
    main()
