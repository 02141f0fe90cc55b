"""Peak memory per rank of `broadcast_strategy='all'` between nodes: before/after sending once per node.

    python bench/broadcast_memory.py [--mib 72] [--nodes 2] [--per-node 2]

nodes x per-node gloo processes (torch.multiprocessing.spawn, LOCAL_WORLD_SIZE=per-node, so a
node is per-node consecutive ranks as under torchrun); every node has its own directory (no shared
storage). Rank 0's directory holds a generated module per rank, a manifest and a `--mib` MiB
``fullmodel.safetensors`` (random bytes: only the size matters). Each rank resets its peak RSS
(``/proc/self/clear_refs`` 5), runs the transfer, and reports VmHWM - VmRSS before (the extra peak).

- ``before``: the previous transfer (kept here verbatim): one ``broadcast_object_list`` of a dict of
  every file's bytes from rank 0 to every rank (pickled, so rank 0 holds the files twice and every
  other rank receives and unpickles the whole payload);
- ``after``: `nnscaler.runtime.driver.broadcast.broadcast_files`: rank 0 sends raw bytes, one file at a
  time, point to point to each node's first rank only; the node's other ranks read the files.

Ratio = after / before of the largest extra peak over the ranks (and per kind of rank).
Result: bench/results/broadcast_memory.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import fmt_bytes, parse_args, run_header, save_results, spawn_gloo, table  # noqa: E402


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _legacy_broadcast(directory: Path, rank: int, local_world: int) -> None:
    """The transfer before this change (runtime/driver/broadcast.py at the issue's time), strategy 'all'."""
    import torch.distributed as dist
    payload = [None]
    if rank == 0:
        payload = [{p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}]
    dist.broadcast_object_list(payload, src=0)
    if rank != 0 and rank % local_world == 0:
        directory.mkdir(parents=True, exist_ok=True)
        for name, data in payload[0].items():
            (directory / name).write_bytes(data)


def measure(rank: int, variant: str, base: str, per_node: int) -> dict:
    import torch.distributed as dist
    from nnscaler.runtime.driver.broadcast import broadcast_files
    directory = Path(base) / f"node{rank // per_node}" / "inst"
    dist.barrier()
    before = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    if variant == "before":
        _legacy_broadcast(directory, rank, per_node)
    else:
        error = broadcast_files(directory, "all", rank)
        assert error is None, error
    dist.barrier()
    peak = _status("VmHWM") - before
    received = sum(p.stat().st_size for p in directory.iterdir()) if rank % per_node == 0 else 0
    return {"rank": rank, "extra_peak_bytes": peak, "role": "rank 0" if rank == 0 else
            ("node leader" if rank % per_node == 0 else "other"), "bytes_in_dir": received}


def prepare(base: Path, mib: int, world: int) -> int:
    directory = base / "node0" / "inst"
    directory.mkdir(parents=True)
    (directory / "fullmodel.safetensors").write_bytes(os.urandom(mib << 20))
    for r in range(world):
        (directory / f"gencode{r}.py").write_text(f"# rank {r}\n" * 200)
    files = {p.name: {"sha256": "-", "size": p.stat().st_size} for p in directory.iterdir()}
    (directory / "manifest.json").write_text(json.dumps({"format": 1, "files": files}))
    return sum(p.stat().st_size for p in directory.iterdir())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=72)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--per-node", type=int, default=2)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "broadcast_memory.json"))
    args = parse_args(ap, {"mib": 1, "nodes": 2, "per_node": 1}, "broadcast_memory.json")
    world = args.nodes * args.per_node
    out = {**run_header(), "config": vars(args), "variants": {}}
    rows = []
    for variant in ("before", "after"):
        with tempfile.TemporaryDirectory() as base:
            payload = prepare(Path(base), args.mib, world)
            res, seconds = spawn_gloo(measure, (variant, base, args.per_node), world,
                                      str(Path(base) / "result.json"), threads=1,
                                      env={"LOCAL_WORLD_SIZE": str(args.per_node)})
        out["payload_bytes"] = payload
        out["variants"][variant] = {"ranks": res, "seconds": seconds,
                                    "max_extra_peak_bytes": max(r["extra_peak_bytes"] for r in res)}
        for r in res:
            rows.append([variant, r["rank"], r["role"], fmt_bytes(r["extra_peak_bytes"]),
                         f"{r['extra_peak_bytes'] / payload:.2f}"])
    b, a = (out["variants"][v]["max_extra_peak_bytes"] for v in ("before", "after"))
    out["ratio_after_over_before"] = a / b
    out["per_rank_ratio"] = [ra["extra_peak_bytes"] / max(rb["extra_peak_bytes"], 1) for rb, ra in
                             zip(out["variants"]["before"]["ranks"], out["variants"]["after"]["ranks"])]
    print(f"payload {fmt_bytes(payload)} to {args.nodes} nodes x {args.per_node} ranks")
    print(table(["variant", "rank", "role", "extra peak", "x payload"], rows))
    print(f"largest extra peak per rank: before {fmt_bytes(b)}, after {fmt_bytes(a)}, ratio {a / b:.3f}")
    save_results(args.out, out)


if __name__ == "__main__":
    main()
