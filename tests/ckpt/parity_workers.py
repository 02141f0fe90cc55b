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


def _writer():
    from nnscaler.ckpt.inflight import OWNER
    return OWNER.background.proc.pid, OWNER.background.buffers_made


def _file_parts(path):
    """(the safetensors header without the asynchronous save's tag, the tensor bytes) of a rank file."""
    import json
    with open(path, "rb") as f:
        data = f.read()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    header["__metadata__"].pop("nnscaler_save", None)
    return header, data[8 + n:]


def _async_after_prepare(pm, opt, out, label, losses, prepared, sharded):
    """An async_save of the state `save` wrote to `sharded`, after prepare_async_save was called
    before the first step: (no buffer made nor process started by it, its rank file is `save`'s)."""
    from nnscaler.ckpt import async_save
    from nnscaler.ckpt.names import rank_file
    path = os.path.join(out, f"{label}-async")
    async_save(path, pm, opt, extra={"step": SAVE_AT, "losses": losses}).wait()
    name = rank_file(dist.get_rank(), dist.get_world_size())
    return _writer() == prepared, _file_parts(os.path.join(path, name)) == _file_parts(os.path.join(sharded, name))


def run_parity(rank, world, tmp, sources, targets):
    """sources: [(plan, plan_ngpus)]; targets: [(source label, plan, plan_ngpus)]. Each source
    also prepares async_save before its first step and async-saves beside its `save` (every plan,
    ZeRO-1 and use_zero=3 among them): `prepared_async` is (the first async_save made no buffer and started no
    process, its rank file is byte for byte `save`'s but for the save's tag)."""
    from nnscaler.ckpt import prepare_async_save, stop_async_saves
    gen, out = os.path.join(tmp, "gen"), os.path.join(tmp, "ckpt")
    os.makedirs(out, exist_ok=True)
    saved, results = {}, {}
    try:
        for plan, n in sources:
            pm, opt = build(plan, n, world, gen)
            prepare_async_save(pm, opt)  # Adam holds no state yet
            prepared = _writer()
            losses = train(pm, opt, 0, SAVE_AT)
            label = f"{plan}{n}"
            saved[label] = _save_all(pm, opt, out, label, losses)
            results[label] = dict(losses=losses, shards=shards(pm), prepared_async=_async_after_prepare(
                pm, opt, out, label, losses, prepared, saved[label]["sharded"]))
        for label, plan, n in targets:
            results[(label, plan, n)] = _continue(plan, n, world, gen, saved[label])
    finally:
        stop_async_saves()
    return results
