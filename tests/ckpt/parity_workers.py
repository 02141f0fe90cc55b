"""The multi-process halves of the resharding parity tests (run by run_workers): train under
plan A, save sharded and deduped (rank 0 also merges), then load each into plan B and train on."""
from __future__ import annotations

import math
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
        before = _gathers(pm)
        try:
            extra = load(paths[kind], pm, opt)
        finally:
            Sources.handle = handle
        gathers = None if before is None else _gathers(pm) - before
        out[kind] = dict(extra=extra, losses=train(pm, opt, SAVE_AT, STEPS), shards=shards(pm), opened=sorted(opened),
                         load_gathers=gathers)
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


def _gathers(pm):
    """The all-gathers of the fully sharded parameters so far (None: not use_zero=3)."""
    return None if pm.fully_sharded is None else pm.fully_sharded.stats.gathers


def _held_facts(pm, opt, out, label, losses, paths):
    """use_zero=3: (the elements of the model tensors in this rank's file of the sharded save: all,
    the largest; the elements its shards hold, the largest unit shard, the whole local model; whether
    the merge of a save of the whole local tensors, the former path inside ``unsharded()``, has the
    same bytes as the merge of the sharded save)."""
    from nnscaler.ckpt import merge, save
    from nnscaler.ckpt.names import rank_file
    header, _ = _file_parts(os.path.join(paths["sharded"], rank_file(dist.get_rank(), dist.get_world_size())))
    stored = [math.prod(v["shape"]) for k, v in header.items() if k.startswith("model/")]
    units = pm.fully_sharded.units
    held = sum(r.stop - r.start for h in pm.held_tensors().values() for r in h.ranges)
    whole = os.path.join(out, f"{label}-whole")
    with pm.unsharded():
        save(whole, pm, opt, extra={"step": SAVE_AT, "losses": losses})
    same = None
    if dist.get_rank() == 0:
        merge(whole, whole + "-merged")
        names = sorted(f for f in os.listdir(paths["merged"]) if f.endswith(".safetensors"))
        same = names == sorted(f for f in os.listdir(whole + "-merged") if f.endswith(".safetensors")) and all(
            _bytes(os.path.join(paths["merged"], f)) == _bytes(os.path.join(whole + "-merged", f)) for f in names)
    dist.barrier()
    return dict(stored=sum(stored), largest=max(stored), held=held, largest_shard=max(u.shard_numel for u in units),
                local=sum(u.numel for u in units), merged_same=same)


def _bytes(path):
    with open(path, "rb") as f:
        return f.read()


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
            gathers = _gathers(pm)
            prepare_async_save(pm, opt)  # Adam holds no state yet
            prepared = _writer()
            gathers = None if gathers is None else _gathers(pm) - gathers
            losses = train(pm, opt, 0, SAVE_AT)
            label = f"{plan}{n}"
            before = _gathers(pm)
            saved[label] = _save_all(pm, opt, out, label, losses)
            async_ok = _async_after_prepare(pm, opt, out, label, losses, prepared, saved[label]["sharded"])
            if before is not None:  # use_zero=3: the shards are written as held
                gathers += _gathers(pm) - before
            results[label] = dict(losses=losses, shards=shards(pm), prepared_async=async_ok, save_gathers=gathers)
            if pm.fully_sharded is not None:
                results[label]["held"] = _held_facts(pm, opt, out, label, losses, saved[label])
        for label, plan, n in targets:
            results[(label, plan, n)] = _continue(plan, n, world, gen, saved[label])
    finally:
        stop_async_saves()
    return results
