"""The multi-process halves of the resharding parity tests (run by run_workers): train under
plan A, save sharded and deduped (rank 0 also merges), then load each into plan B and train on."""
from __future__ import annotations

import os

import torch.distributed as dist

from training import SAVE_AT, STEPS, build, shards, train


def _save_all(pm, opt, out: str, label: str, losses):
    from nnscaler.ckpt import merge, save
    paths = {kind: os.path.join(out, f"{label}-{kind}") for kind in ("sharded", "deduped", "merged")}
    save(paths["sharded"], pm, opt, extra={"step": SAVE_AT, "losses": losses})
    save(paths["deduped"], pm, opt, kind="deduped", extra={"step": SAVE_AT, "losses": losses})
    if dist.get_rank() == 0:
        merge(paths["sharded"], paths["merged"])
    dist.barrier()
    return paths


def _continue(target, plan_ngpus, world, gen, paths, kinds=("sharded", "deduped", "merged")):
    from nnscaler.ckpt import load
    from nnscaler.ckpt.sources import Sources
    pm, opt = build(target, plan_ngpus, world, gen, seed=1)
    out = {}
    handle = Sources.handle
    for kind in kinds:
        opened = set()

        def recording(self, file, _opened=opened):
            _opened.add(file)
            return handle(self, file)
        Sources.handle = recording
        try:
            extra = load(paths[kind], pm, opt)
        finally:
            Sources.handle = handle
        out[kind] = dict(extra=extra, losses=train(pm, opt, SAVE_AT, STEPS), shards=shards(pm), opened=sorted(opened))
    return out


def run_parity(rank, world, tmp, sources, targets):
    """sources: [(plan, plan_ngpus)]; targets: [(source label, plan, plan_ngpus)]."""
    gen, out = os.path.join(tmp, "gen"), os.path.join(tmp, "ckpt")
    os.makedirs(out, exist_ok=True)
    saved, results = {}, {}
    for plan, n in sources:
        pm, opt = build(plan, n, world, gen)
        losses = train(pm, opt, 0, SAVE_AT)
        label = f"{plan}{n}"
        saved[label] = _save_all(pm, opt, out, label, losses)
        results[label] = dict(losses=losses, shards=shards(pm))
    for label, plan, n in targets:
        results[(label, plan, n)] = _continue(plan, n, world, gen, saved[label])
    return results
