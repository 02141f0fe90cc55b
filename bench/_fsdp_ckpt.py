"""bench/fsdp.py part 5 (`--parts ckpt`): what a checkpoint of a `use_zero=3` model adds to a rank's
resident set (not part of nnscaler).

In the worker (after the build and one training step, so that Adam's state exists), each operation
runs alone between barriers: `_rss.release()`, the peak reset (VmHWM := VmRSS), the operation, and
its *added* RSS = max(VmHWM, a 2 ms sampler) - the RSS at the reset. Operations, in this order:

* ``save``: `nnscaler.ckpt.save` (sharded) of the shards as held;
* ``load``: `nnscaler.ckpt.load` of that checkpoint into the same model and optimizer;
* ``async_save``: the first `async_save` of the process (it makes the shared buffer, the writer's
  buffer, and starts the background process), waited for; ``async_save (again)``: the next one
  (the buffer exists);
* ``save (whole tensors)`` / ``load (whole tensors)``: the same inside ``model.unsharded()``
  (``writeback=True`` for the load): the former path, where each rank holds its whole local model.

The rank's *shard* is the bytes of the tensors in its rank file of the ``save`` (its parameters'
shard and its optimizer state). Target (issue 43 §3): added <= 1.1 x shard + writer's buffer, i.e.
``(added - buffer) / shard <= 1.1`` (the sync writer writes from the tensors: no buffer). The
background process's own memory is not counted (another process). The parameters are checked
equal after each load.
"""
from __future__ import annotations

import json
import os
import time
from typing import Callable, Dict

import _rss
import torch
import torch.distributed as dist

TARGET = 1.1
OPS = ("save", "load", "async_save", "async_save (again)", "save (whole tensors)", "load (whole tensors)")


def _measure(fn: Callable[[], None]) -> Dict[str, float]:
    dist.barrier()
    _rss.release()
    start = _rss.reset_peak()
    sampler = _rss.Sampler()
    t = time.perf_counter()
    fn()
    seconds = time.perf_counter() - t
    peak = max(_rss.status("VmHWM"), sampler.stop())
    dist.barrier()
    return {"added": peak - start, "rss_before": start, "s": seconds}


def _file_bytes(path: str) -> Dict[str, int]:
    """Bytes of the model and optimizer tensors in a rank file (its safetensors header)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    out = {"model": 0, "optim": 0}
    for key, v in header.items():
        kind = key.split("/", 1)[0]
        if kind in out:
            out[kind] += v["data_offsets"][1] - v["data_offsets"][0]
    return out


def _fingerprint(model) -> float:
    return float(sum(u.shard.detach().double().sum() for u in model.fully_sharded.units))


def measure(model, opt, out_dir: str) -> dict:
    """The operations of the module docstring on this rank; its figures."""
    from nnscaler.ckpt import async_save, load, save, stop_async_saves
    from nnscaler.ckpt.inflight import OWNER
    from nnscaler.ckpt.names import rank_file
    rank, world = dist.get_rank(), dist.get_world_size()
    os.makedirs(out_dir, exist_ok=True)
    path = {k: os.path.join(out_dir, k) for k in ("sharded", "async", "async2", "whole")}
    before = _fingerprint(model)
    gathers = model.fully_sharded.stats.gathers
    ops = {"save": _measure(lambda: save(path["sharded"], model, opt)),
           "load": _measure(lambda: load(path["sharded"], model, opt))}
    ops["async_save"] = _measure(lambda: async_save(path["async"], model, opt).wait())
    buffer = OWNER.background.buffer.numel()
    ops["async_save (again)"] = _measure(lambda: async_save(path["async2"], model, opt).wait())
    no_gathers = model.fully_sharded.stats.gathers == gathers
    same_after_load = _fingerprint(model) == before

    def whole_save():
        with model.unsharded():
            save(path["whole"], model, opt)

    def whole_load():
        with model.unsharded(writeback=True):
            load(path["whole"], model, opt)
    ops["save (whole tensors)"] = _measure(whole_save)
    ops["load (whole tensors)"] = _measure(whole_load)
    same_after_whole = _fingerprint(model) == before
    stop_async_saves(release=True)
    shard = _file_bytes(os.path.join(path["sharded"], rank_file(rank, world)))
    whole = _file_bytes(os.path.join(path["whole"], rank_file(rank, world)))
    return {"rank": rank, "ops": ops, "shard_bytes": shard["model"] + shard["optim"], "shard_parts": shard,
            "whole_file_bytes": whole["model"] + whole["optim"], "async_buffer_bytes": buffer,
            "no_gathers": no_gathers, "same_after_load": same_after_load, "same_after_whole_load": same_after_whole}


def summary(ranks: list) -> dict:
    """Per operation: the larger rank's added RSS and its ratio (added - writer's buffer) / shard."""
    out = {"per_rank": ranks, "ops": {}, "target": TARGET,
           "checks": {k: all(r[k] for r in ranks) for k in ("no_gathers", "same_after_load", "same_after_whole_load")}}
    for op in OPS:
        ratios = []
        for r in ranks:
            buffer = r["async_buffer_bytes"] if op == "async_save" else 0
            ratios.append(((r["ops"][op]["added"] - buffer) / r["shard_bytes"], r))
        ratio, r = max(ratios, key=lambda x: x[0])
        out["ops"][op] = {"added": r["ops"][op]["added"], "shard_bytes": r["shard_bytes"], "rank": r["rank"],
                          "buffer_bytes": r["async_buffer_bytes"] if op == "async_save" else 0,
                          "ratio": ratio, "s": r["ops"][op]["s"],
                          "met": ratio <= TARGET if op in ("save", "load", "async_save") else None}
    return out


def report(s: dict, table, fmt_mib) -> str:
    rows = [[op, fmt_mib(x["added"]), fmt_mib(x["shard_bytes"]), fmt_mib(x["buffer_bytes"]), f"{x['ratio']:.3f}",
             f"<= {TARGET}" if x["met"] is not None else "-", "-" if x["met"] is None else ("yes" if x["met"] else "NO"),
             f"{x['s']:.2f}"] for op, x in s["ops"].items()]
    return table(["operation", "RSS added MiB", "rank's shard", "writer's buffer", "(added - buffer) / shard",
                  "target", "met", "s"], rows)
