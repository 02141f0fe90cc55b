"""Checkpoint I/O of nnscaler.ckpt against the same bytes moved by the reference tools.

* save / load: `nnscaler.ckpt.save` (sharded, hashing while writing) and `load` (same plan,
  SHA-256 checked first, and without the check) of a model sharded over `--ranks` gloo processes,
  against `safetensors.torch.save_file` / `load_file` of the same tensors by the same ranks, in
  the same run. Throughput = bytes / slowest rank's seconds.
* merge: `nnscaler.ckpt.merge` of that checkpoint (a fresh interpreter; with and without the
  source hash check) against `cp -r` of the same directory; peak RSS above the interpreter's
  RSS before merging, against the largest tensor.

    python bench/ckpt.py                 # 2 GiB, 8 tensors, 4 ranks (~2-3 min on 2 cores)
    python bench/ckpt.py --gib 0.25      # a quick run
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import loadavg, run_header, save_results, spawn_gloo, table  # noqa: E402


def fmt_bytes(b: float) -> str:
    return f"{b / 2**20:,.0f} MiB"

_MERGE = """
import json, resource, sys, time
import nnscaler.ckpt as ckpt
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
t = time.perf_counter()
ckpt.merge(sys.argv[1], sys.argv[2], verify=sys.argv[3] == "1")
seconds = time.perf_counter() - t
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"seconds": seconds, "rss_before": before, "rss_peak": peak}))
"""


def _module(rank: int, world: int, rows: int, cols: int, ntensors: int):
    """A stand-in parallelized module: rank r holds rows [r*rows/world, (r+1)*rows/world) of each tensor."""
    import torch
    from nnscaler.ir.contracts import FullMapEntry

    class Sharded(torch.nn.Module):
        COMPUTE_CONFIG = {"plan_ngpus": world, "runtime_ngpus": world}
        GRAPH_FINGERPRINT = "bench"

    m = Sharded()
    m.fullmap = {}
    per = rows // world
    g = torch.Generator().manual_seed(rank)
    for i in range(ntensors):
        local = f"w{i}"
        m.register_parameter(local, torch.nn.Parameter(torch.empty(per, cols).uniform_(generator=g)))
        m.fullmap[local] = FullMapEntry(local, f"layers.{i}.weight", (rows, cols),
                                        ((rank * per, (rank + 1) * per), (0, cols)))
    return m


def _timed(fn):
    import torch.distributed as dist
    dist.barrier()
    t = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t


def _ranks(rank: int, world: int, rows: int, cols: int, ntensors: int, root: str, repeat: int):
    import torch
    from safetensors.torch import load_file, save_file
    import nnscaler.ckpt as ckpt
    m = _module(rank, world, rows, cols, ntensors)
    tensors = {k: v.detach() for k, v in m.named_parameters()}
    out = {k: [] for k in ("save_file", "save", "load_file", "load", "load_no_verify")}
    ref_dir = Path(root, "safetensors")
    ref_dir.mkdir(exist_ok=True)
    for _ in range(repeat):  # alternated, so that both see the same state of the page cache
        out["save_file"].append(_timed(lambda: save_file(tensors, str(ref_dir / f"rank{rank}.safetensors"))))
        out["save"].append(_timed(lambda: ckpt.save(Path(root, "ck"), m, overwrite=True)))
    target = _module(rank, world, rows, cols, ntensors)
    with torch.no_grad():
        for p in target.parameters():
            p.zero_()

    def load_reference():  # read the file and set the module's tensors, as load() does
        loaded = load_file(str(ref_dir / f"rank{rank}.safetensors"))
        with torch.no_grad():
            for name, p in target.named_parameters():
                p.copy_(loaded[name])
    for _ in range(repeat):
        out["load_file"].append(_timed(load_reference))
        with torch.no_grad():
            for p in target.parameters():
                p.zero_()
        out["load"].append(_timed(lambda: ckpt.load(Path(root, "ck"), target)))
        out["load_no_verify"].append(_timed(lambda: ckpt.load(Path(root, "ck"), target, verify=False)))
    out = {k: statistics.median(v) for k, v in out.items()}
    out["exact"] = all(torch.equal(a, b) for a, b in zip(m.parameters(), target.parameters()))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=2.0, help="model size in GiB (float32)")
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3, help="runs of each measurement (medians are reported)")
    ap.add_argument("--workdir", default=None, help="where the checkpoints go (default: a temporary directory)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "ckpt.json"))
    args = ap.parse_args()
    cols = 4096
    rows = int(args.gib * 2**30 / 4 / args.tensors / cols) // args.ranks * args.ranks
    tensor_bytes = rows * cols * 4
    total = tensor_bytes * args.tensors
    load_before = loadavg()  # I/O and hashing figures swing with what else the machine runs
    root = Path(tempfile.mkdtemp(prefix="nnscaler-bench-ckpt-", dir=args.workdir))
    try:
        per_rank, _ = spawn_gloo(_ranks, (args.ranks, rows, cols, args.tensors, str(root), args.repeat), args.ranks,
                                 str(root / "result.json"))
        slowest = {k: max(r[k] for r in per_rank) for k in ("save", "save_file", "load", "load_no_verify",
                                                            "load_file")}
        cps, cp_syncs, runs = [], [], {"verify": [], "no_verify": []}
        for _ in range(args.repeat):  # alternated: cp, merge with the hash check, merge without
            subprocess.run(["sync"], check=True)
            t = time.perf_counter()
            subprocess.run(["cp", "-r", str(root / "ck"), str(root / "copy")], check=True)
            cps.append(time.perf_counter() - t)
            subprocess.run(["sync", "-f", str(root / "copy")], check=True)  # cp does not fsync; merge does
            cp_syncs.append(time.perf_counter() - t)
            shutil.rmtree(root / "copy")
            for verify in (True, False):
                subprocess.run(["sync"], check=True)
                dst = root / f"merged-{int(verify)}"
                out = subprocess.run([sys.executable, "-c", _MERGE, str(root / "ck"), str(dst), str(int(verify))],
                                     capture_output=True, text=True, check=True)
                runs["verify" if verify else "no_verify"].append(json.loads(out.stdout.strip().splitlines()[-1]))
                shutil.rmtree(dst)
        cp_seconds, cp_sync_seconds = statistics.median(cps), statistics.median(cp_syncs)
        merges = {k: {"seconds": statistics.median(r["seconds"] for r in v), "all_seconds": [r["seconds"] for r in v],
                      "rss_before": max(r["rss_before"] for r in v), "rss_peak": max(r["rss_peak"] for r in v)}
                  for k, v in runs.items()}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    gbs = lambda s: total / s / 1e9  # noqa: E731
    result = {
        **run_header(),
        "loadavg": {"before": load_before, "after": loadavg()},
        "config": {"gib": args.gib, "tensors": args.tensors, "ranks": args.ranks, "tensor_shape": [rows, cols],
                   "bytes": total, "largest_tensor_bytes": tensor_bytes},
        "save": {"seconds": slowest["save"], "GBps": gbs(slowest["save"]),
                 "ref_save_file_seconds": slowest["save_file"], "ratio_vs_save_file": slowest["save_file"] /
                 slowest["save"]},
        "load": {"seconds": slowest["load"], "GBps": gbs(slowest["load"]),
                 "seconds_no_verify": slowest["load_no_verify"], "ref_load_file_seconds": slowest["load_file"],
                 "ratio_vs_load_file": slowest["load_file"] / slowest["load"],
                 "ratio_vs_load_file_no_verify": slowest["load_file"] / slowest["load_no_verify"],
                 "exact": all(r["exact"] for r in per_rank)},
        "merge": {**{k: {**v, "GBps": gbs(v["seconds"]), "ratio_vs_cp": cp_seconds / v["seconds"],
                         "ratio_vs_cp_then_sync": cp_sync_seconds / v["seconds"],
                         "extra_rss_bytes": v["rss_peak"] - v["rss_before"],
                         "extra_rss_minus_largest_tensor": v["rss_peak"] - v["rss_before"] - tensor_bytes}
                     for k, v in merges.items()},
                  "cp_seconds": cp_seconds, "cp_GBps": gbs(cp_seconds), "cp_then_sync_seconds": cp_sync_seconds,
                  "cp_then_sync_GBps": gbs(cp_sync_seconds), "cp_all_seconds": cps,
                  "cp_then_sync_all_seconds": cp_syncs},
        "per_rank": per_rank,
    }
    rows_ = [["save vs save_file", f"{result['save']['GBps']:.2f} GB/s", f"{result['save']['ratio_vs_save_file']:.2f}"],
             ["load vs load_file", f"{result['load']['GBps']:.2f} GB/s", f"{result['load']['ratio_vs_load_file']:.2f}"],
             ["load (no hash) vs load_file", f"{gbs(slowest['load_no_verify']):.2f} GB/s",
              f"{result['load']['ratio_vs_load_file_no_verify']:.2f}"]]
    for k, v in result["merge"].items():
        if isinstance(v, dict):
            rows_.append([f"merge ({k}) vs cp | cp + sync", f"{v['GBps']:.2f} GB/s",
                          f"{v['ratio_vs_cp']:.2f} | {v['ratio_vs_cp_then_sync']:.2f}  extra RSS "
                          f"{fmt_bytes(v['extra_rss_bytes'])} (largest tensor {fmt_bytes(tensor_bytes)})"])
    print(f"{fmt_bytes(total)} in {args.tensors} tensors over {args.ranks} ranks")
    print(table(["what", "throughput", "ratio to reference"], rows_))
    save_results(args.out, result)


if __name__ == "__main__":
    main()
