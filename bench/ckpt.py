"""Checkpoint I/O of nnscaler.ckpt against the same bytes moved by the reference tools.

* save / load: `nnscaler.ckpt.save` (sharded; CRC-32 while writing, the SHA-256 after the commit,
  whose time is reported as ``after_commit_seconds``) and `load` at each
  verification level (``"fast"``: the default, size + chunked CRC-32; ``"sha256"``; ``"size"``)
  of a model sharded over `--ranks` gloo processes, against `safetensors.torch.save_file` /
  `load_file` of the same tensors by the same ranks, in the same run. Throughput = bytes /
  slowest rank's seconds.
* merge: `nnscaler.ckpt.merge` of that checkpoint (a fresh interpreter; each verification level)
  against `cp -r` of the same directory, `cp` + `sync` (merge fsyncs) and `cp` + SHA-256 of the
  copy (a verified copy); peak RSS above the interpreter's RSS before merging, against the
  largest tensor.
* floors: SHA-256 and CRC-32 rates of one core measured in the same run, and what they imply:
  a merged file's SHA-256 is one sequential stream, so no merge can beat bytes / SHA-256 rate.
* async: the time `nnscaler.ckpt.async_save` blocks its caller against `save` and against
  `torch.distributed.checkpoint.async_save` of the same tensors by the same ranks (each blocking
  time: until the call returns on the slowest rank; also until the save is committed), and the
  time of a training step (a small MLP, forward + backward + SGD) while a background save runs
  against without one, for both. Each rank runs with cores // ranks threads.
* first async_save: in processes without a background process or buffer yet (the model plus Adam's
  state), the time the first `async_save` blocks against a synchronous `save` of the same state in
  the same process, without `prepare_async_save`, with it after the optimizer's first step, and
  with it before that step (Adam's state then estimated); the second `async_save` of each too.

    python bench/ckpt.py                 # 2 GiB, 8 tensors, 4 ranks (~4 min on 2 cores)
    python bench/ckpt.py --gib 0.25      # a quick run
    python bench/ckpt.py --only merge    # save once, then merge against cp only (bench/results/ckpt_merge.json)
    python bench/ckpt.py --only async --gib 0.5 --ranks 2   # the async section alone (bench/results/ckpt_async.json)
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import cpu_count, loadavg, parse_args, run_header, save_results, spawn_gloo, table  # noqa: E402


LEVELS = ("fast", "sha256", "size")


def fmt_bytes(b: float) -> str:
    return f"{b / 2**20:,.0f} MiB"


def hash_rates(nbytes: int = 256 * 2**20, repeat: int = 3) -> dict:
    """GB/s of SHA-256 and zlib CRC-32 on one core (best of `repeat`), over a buffer in memory."""
    import hashlib
    import zlib
    buf = memoryview(bytes(range(256)) * (nbytes // 256))
    out = {}
    for name, fn in (("sha256", lambda: hashlib.sha256(buf).digest()), ("crc32", lambda: zlib.crc32(buf))):
        best = float("inf")
        for _ in range(repeat):
            t = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t)
        out[f"{name}_GBps"] = nbytes / best / 1e9
    return out


def sha256_file(path) -> str:
    import hashlib
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while block := f.read(16 * 2**20):
            h.update(block)
    return h.hexdigest()

_MERGE = """
import json, resource, sys, time
import nnscaler.ckpt as ckpt
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
t = time.perf_counter()
ckpt.merge(sys.argv[1], sys.argv[2], verify=sys.argv[3])
seconds = time.perf_counter() - t
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"seconds": seconds, "rss_before": before, "rss_peak": peak}))
"""


def _module(rank: int, world: int, rows: int, cols: int, ntensors: int):
    """A stand-in parallelized module: rank r holds rows [r*rows/world, (r+1)*rows/world) of each tensor."""
    import torch
    from nnscaler.ir.contracts import FullMapEntry, GeneratedAttrs

    class Sharded(GeneratedAttrs, torch.nn.Module):
        COMPUTE_CONFIG = {"plan_ngpus": world, "runtime_ngpus": world}
        GRAPH_FINGERPRINT = "bench"

    m = Sharded()
    m.fullmap, m.full_aliases = {}, {}
    per = rows // world
    g = torch.Generator().manual_seed(rank)
    for i in range(ntensors):
        local = f"w{i}"
        m.register_parameter(local, torch.nn.Parameter(torch.empty(per, cols).uniform_(generator=g)))
        m.fullmap[local] = FullMapEntry(local, f"layers.{i}.weight", (rows, cols),
                                        ((rank * per, (rank + 1) * per), (0, cols)))
    return m


def _timed(fn):
    """Seconds of `fn` on the slowest rank; dirty pages of what ran before are written out first, so
    that no measurement pays for the writeback of the previous one."""
    import torch.distributed as dist
    os.sync()
    dist.barrier()
    t = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t


def _settle() -> None:
    """Wait for what `save` leaves for after its commit (a thread of rank 0: the SHA-256 of large
    files, the deletion of the replaced checkpoint), then for every rank, so that it slows down
    no later measurement."""
    import torch.distributed as dist
    from nnscaler.ckpt import after_commit
    after_commit.wait()
    dist.barrier()


def _save_file_fsync(save_file, tensors, path) -> None:
    save_file(tensors, str(path))
    fd = os.open(str(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _ranks(rank: int, world: int, rows: int, cols: int, ntensors: int, root: str, repeat: int):
    import torch
    from safetensors.torch import load_file, save_file
    import nnscaler.ckpt as ckpt
    m = _module(rank, world, rows, cols, ntensors)
    tensors = {k: v.detach() for k, v in m.named_parameters()}
    out = {k: [] for k in ("save_file", "save_file_fsync", "save", "save_after_commit", "load_file", "load",
                           "load_sha256", "load_no_verify")}
    ref_dir = Path(root, "safetensors")
    ref_dir.mkdir(exist_ok=True)
    for i in range(repeat + 1):  # alternated, so that both see the same state of the page cache; the
        # first round is a warm-up, not counted (the first writes of 2 GiB into memory the VM has not
        # touched yet are slow: 2-3 s for either, then ~1 s)
        if i == 1:
            out = {k: [] for k in out}
        out["save_file"].append(_timed(lambda: save_file(tensors, str(ref_dir / f"rank{rank}.safetensors"))))
        # the durable reference: our save fsyncs (a crash must not lose a committed checkpoint)
        out["save_file_fsync"].append(_timed(lambda: _save_file_fsync(save_file, tensors,
                                                                       ref_dir / f"rank{rank}-fsync.safetensors")))
        out["save"].append(_timed(lambda: ckpt.save(Path(root, "ck"), m, overwrite=True)))
        t = time.perf_counter()
        _settle()
        out["save_after_commit"].append(time.perf_counter() - t)
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
        out["load"].append(_timed(lambda: ckpt.load(Path(root, "ck"), target)))  # verify="fast"
        out["load_sha256"].append(_timed(lambda: ckpt.load(Path(root, "ck"), target, verify="sha256")))
        out["load_no_verify"].append(_timed(lambda: ckpt.load(Path(root, "ck"), target, verify="size")))
    runs = {f"{k}_runs": list(out[k]) for k in ("save", "save_file_fsync", "save_file")}
    out = {**{k: statistics.median(v) for k, v in out.items()}, **runs}
    out["exact"] = all(torch.equal(a, b) for a, b in zip(m.parameters(), target.parameters()))
    return out


def _save_once(rank: int, world: int, rows: int, cols: int, ntensors: int, root: str):
    """One `save` of the model (what `--only merge` merges), its after-commit work included."""
    import nnscaler.ckpt as ckpt
    ckpt.save(Path(root, "ck"), _module(rank, world, rows, cols, ntensors))
    _settle()
    return {}


def _merge_figures(root: Path, total: int, tensor_bytes: int, rates: dict, repeat: int) -> dict:
    """merge of ``root/ck`` at each level against cp, cp + sync and cp + SHA-256 of the same directory
    (alternated, each after `sync`), with the floors the one-core hash rates imply."""
    ref = {"cp": [], "cp_then_sync": [], "cp_then_sha256": []}
    runs = {level: [] for level in LEVELS}
    for _ in range(repeat):  # alternated: the references, then merge at each level
        subprocess.run(["sync"], check=True)
        t = time.perf_counter()
        subprocess.run(["cp", "-r", str(root / "ck"), str(root / "copy")], check=True)
        ref["cp"].append(time.perf_counter() - t)
        subprocess.run(["sync", "-f", str(root / "copy")], check=True)  # cp does not fsync; merge does
        ref["cp_then_sync"].append(time.perf_counter() - t)
        shutil.rmtree(root / "copy")
        subprocess.run(["sync"], check=True)
        t = time.perf_counter()
        subprocess.run(["cp", "-r", str(root / "ck"), str(root / "copy")], check=True)
        for f in sorted((root / "copy").iterdir()):  # what sha256sum of the copy does: one stream
            sha256_file(f)
        ref["cp_then_sha256"].append(time.perf_counter() - t)
        shutil.rmtree(root / "copy")
        for level in LEVELS:
            subprocess.run(["sync"], check=True)
            dst = root / f"merged-{level}"
            out = subprocess.run([sys.executable, "-c", _MERGE, str(root / "ck"), str(dst), level],
                                 capture_output=True, text=True, check=True)
            runs[level].append(json.loads(out.stdout.strip().splitlines()[-1]))
            shutil.rmtree(dst)
    refs = {k: statistics.median(v) for k, v in ref.items()}
    merges = {k: {"seconds": statistics.median(r["seconds"] for r in v), "all_seconds": [r["seconds"] for r in v],
                  "rss_before": max(r["rss_before"] for r in v), "rss_peak": max(r["rss_peak"] for r in v)}
              for k, v in runs.items()}
    gbs = lambda s: total / s / 1e9  # noqa: E731
    cores = cpu_count()
    # floors: the merged model file's SHA-256 is one sequential stream on one core ...
    sha_floor = total / rates["sha256_GBps"] / 1e9
    # ... and the CPU of a fast-verified merge spread perfectly over the cores: the output's
    # SHA-256, one CRC-32 pass (the CRC-32 of each copied window serves the output's chunks and the
    # sources' check), plus the copy itself (cp's time: kernel CPU)
    cpu_floor = (sha_floor + total / rates["crc32_GBps"] / 1e9 + refs["cp"]) / cores
    merge_floor = max(sha_floor, cpu_floor, refs["cp"])
    best_floor = max(sha_floor, (sha_floor + total / rates["crc32_GBps"] / 1e9 + min(ref["cp"])) / cores,
                     min(ref["cp"]))
    return {**{k: {**v, "GBps": gbs(v["seconds"]), "ratio_vs_cp": refs["cp"] / v["seconds"],
                   "ratio_vs_cp_then_sync": refs["cp_then_sync"] / v["seconds"],
                   "ratio_vs_cp_then_sha256": refs["cp_then_sha256"] / v["seconds"],
                   "ratio_vs_floor": merge_floor / v["seconds"],
                   "ratio_vs_sha256_stream": sha_floor / v["seconds"],
                   "best_seconds": min(v["all_seconds"]),  # the I/O of a shared machine swings 5x
                   "best_ratio_vs_cp": min(ref["cp"]) / min(v["all_seconds"]),
                   "best_ratio_vs_cp_then_sync": min(ref["cp_then_sync"]) / min(v["all_seconds"]),
                   "best_ratio_vs_cp_then_sha256": min(ref["cp_then_sha256"]) / min(v["all_seconds"]),
                   "best_ratio_vs_floor": best_floor / min(v["all_seconds"]),
                   "extra_rss_bytes": v["rss_peak"] - v["rss_before"],
                   "extra_rss_minus_largest_tensor": v["rss_peak"] - v["rss_before"] - tensor_bytes}
               for k, v in merges.items()},
            **{f"{k}_seconds": v for k, v in refs.items()}, **{f"{k}_all_seconds": v for k, v in ref.items()},
            "cp_GBps": gbs(refs["cp"]), "cp_then_sync_GBps": gbs(refs["cp_then_sync"]),
            "floor_seconds": merge_floor, "floor_sha256_stream_seconds": sha_floor,
            "floor_cpu_seconds": cpu_floor,
            "floor_note": "max(cp, bytes / SHA-256 rate (the merged file's SHA-256 is one stream), (bytes / SHA-256 "
                          "rate + bytes / CRC-32 rate + cp) / cores (all the CPU work on all cores: one CRC-32 pass "
                          "serves the output and the sources' check))",
            "ratio_floor_vs_cp": refs["cp"] / merge_floor, "best_floor_seconds": best_floor,
            "best_ratio_floor_vs_cp": min(ref["cp"]) / best_floor}


def _merge_rows(merge: dict, tensor_bytes: int) -> list:
    r = lambda x: f"{x:.2f}"  # noqa: E731
    rows = []
    for k in LEVELS:
        v = merge[k]
        rows.append([f"merge ({k}) vs cp | cp+sync | cp+sha256 | floor | SHA-256 stream", f"{v['GBps']:.2f} GB/s",
                     f"{r(v['ratio_vs_cp'])} | {r(v['ratio_vs_cp_then_sync'])} | {r(v['ratio_vs_cp_then_sha256'])} | "
                     f"{r(v['ratio_vs_floor'])} | {r(v['ratio_vs_sha256_stream'])} (best of runs: "
                     f"{r(v['best_ratio_vs_cp'])} | {r(v['best_ratio_vs_cp_then_sync'])} | "
                     f"{r(v['best_ratio_vs_cp_then_sha256'])} | {r(v['best_ratio_vs_floor'])})  extra RSS "
                     f"{fmt_bytes(v['extra_rss_bytes'])} (largest tensor {fmt_bytes(tensor_bytes)})"])
    return rows


def _mlp(threads: int):
    """A training step of a small MLP (the work a background save competes with)."""
    import torch
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512))
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    x = torch.randn(64, 512)

    def step():
        opt.zero_grad()
        net(x).square().mean().backward()
        opt.step()
    return step


def _steps(step, n: int) -> float:
    """Seconds per step, mean of `n` steps."""
    t = time.perf_counter()
    for _ in range(n):
        step()
    return (time.perf_counter() - t) / n


def _in_background(out: dict, name: str, start, finish, step, steps: int) -> None:
    """Time `start()` (until it returns on the slowest rank), `steps` training steps right after,
    while the save runs, then until `finish(start's result)` returns on every rank."""
    import torch.distributed as dist
    started = []
    out[f"{name}_blocking"].append(_timed(lambda: started.append(start())))
    t = time.perf_counter()
    out[f"step_during_{name}"].append(_steps(step, steps))
    finish(started[0])
    out[f"{name}_background"].append(time.perf_counter() - t)
    dist.barrier()
    out[f"{name}_total"].append(out[f"{name}_blocking"][-1] + time.perf_counter() - t)


def _async_ranks(rank: int, world: int, rows: int, cols: int, ntensors: int, root: str, repeat: int, steps: int):
    """Blocking and total times of save / async_save / DCP async_save, and step times during each."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import nnscaler.ckpt as ckpt
    m = _module(rank, world, rows, cols, ntensors)
    state = {k: v.detach() for k, v in m.named_parameters()}
    step = _mlp(torch.get_num_threads())
    _steps(step, 3)  # warm-up
    out = {k: [] for k in ("save", "async_blocking", "async_total", "dcp_blocking", "dcp_total", "step_idle",
                           "step_during_async", "step_during_dcp", "async_background", "dcp_background")}
    t = time.perf_counter()  # the first call also starts this rank's background process and makes its buffer
    ckpt.async_save(Path(root, "ck-async"), m, overwrite=True).wait()
    dist.barrier()
    out["async_first_call_total"] = time.perf_counter() - t
    group = dist.new_group(backend="gloo")  # DCP's background thread runs collectives: its own group, as
    # torchtitan gives it (on the default one they interleave with the caller's barriers and hang)
    dcp_save = lambda i: dcp.async_save(state, checkpoint_id=str(Path(root, f"dcp-{i}")),  # noqa: E731
                                        process_group=group)
    dcp_save("warm").result()  # DCP's first call: warm-up
    for i in range(repeat):  # alternated, so that all see the same state of the page cache
        out["save"].append(_timed(lambda: ckpt.save(Path(root, "ck-sync"), m, overwrite=True)))
        _settle()
        out["step_idle"].append(_steps(step, steps))
        _in_background(out, "async", lambda: ckpt.async_save(Path(root, "ck-async"), m, overwrite=True),
                       lambda h: h.wait(), step, steps)
        _in_background(out, "dcp", lambda: dcp_save(i), lambda f: f.result(), step, steps)
    ckpt.stop_async_saves()
    res = {k: statistics.median(v) for k, v in out.items() if isinstance(v, list)}
    res["async_first_call_total"] = out["async_first_call_total"]
    res["threads"] = torch.get_num_threads()
    return res


FIRST_VARIANTS = ("unprepared", "prepared", "prepared_before_step")


def _first_async_ranks(rank: int, world: int, rows: int, cols: int, ntensors: int, root: str, wait: float):
    """For each variant, from a process without background process or buffer (`stop_async_saves(
    release=True)` between them): a model and its Adam optimizer after one step; `save` timed (after
    a warm-up save), then the first async_save timed, then a second one. Variants: unprepared;
    prepared (prepare_async_save after the optimizer's first step); prepared_before_step
    (prepare_async_save before it: Adam holds no state yet, its first step's is estimated)."""
    import torch
    import torch.distributed as dist
    import nnscaler.ckpt as ckpt
    from nnscaler.ckpt.inflight import OWNER
    results = {}
    for variant in FIRST_VARIANTS:
        ckpt.stop_async_saves(release=True)
        m = _module(rank, world, rows, cols, ntensors)
        opt = torch.optim.Adam(m.parameters(), lr=1e-3)
        out = results[variant] = {}

        def prepare():
            t = time.perf_counter()
            out["prepare_buffer_bytes"] = ckpt.prepare_async_save(m, opt)
            out["prepare_seconds"] = time.perf_counter() - t
        if variant == "prepared_before_step":
            prepare()
        for p in m.parameters():
            p.grad = torch.full_like(p, 1e-3)
        opt.step()
        if variant == "prepared":
            prepare()
        background = OWNER.background
        out["state_bytes"] = sum(t.numel() * t.element_size() for t in m.parameters()) + sum(
            v.numel() * v.element_size() for s in opt.state.values() for v in s.values())
        ckpt.save(Path(root, "sync"), m, opt, overwrite=True)  # warm-up: the first save into fresh page cache
        _settle()
        out["save"] = _timed(lambda: ckpt.save(Path(root, "sync"), m, opt, overwrite=True))
        _settle()
        time.sleep(wait)  # training would run here: a prepared background process has finished starting
        before = (background.proc.pid if background.proc is not None else None, background.buffers_made)
        handles = []
        out["first_blocking"] = _timed(lambda: handles.append(ckpt.async_save(Path(root, "async"), m, opt,
                                                                              overwrite=True)))
        out["first_started_process"] = before[0] != background.proc.pid
        out["first_made_buffer"] = before[1] != background.buffers_made
        handles.pop().wait()
        dist.barrier()
        out["second_blocking"] = _timed(lambda: handles.append(ckpt.async_save(Path(root, "async"), m, opt,
                                                                               overwrite=True)))
        handles.pop().wait()
        dist.barrier()
        del m, opt
    ckpt.stop_async_saves(release=True)
    return results


def _first_figures(per_rank: list) -> dict:
    """Per variant: slowest rank's seconds and the ratios to `save` of the same run."""
    out = {}
    for variant in FIRST_VARIANTS:
        ranks = [r[variant] for r in per_rank]
        slowest = {k: max(r[k] for r in ranks) for k in ("save", "first_blocking", "second_blocking")}
        out[variant] = {
            "save_seconds": slowest["save"], "first_blocking_seconds": slowest["first_blocking"],
            "second_blocking_seconds": slowest["second_blocking"],
            "ratio_first_blocking_vs_save": slowest["first_blocking"] / slowest["save"],
            "ratio_second_blocking_vs_save": slowest["second_blocking"] / slowest["save"],
            "first_started_process": any(r["first_started_process"] for r in ranks),
            "first_made_buffer": any(r["first_made_buffer"] for r in ranks),
            "prepare_seconds": max((r["prepare_seconds"] for r in ranks if "prepare_seconds" in r), default=None),
            "state_bytes_per_rank": ranks[0]["state_bytes"],
            "per_rank": ranks}
    return out


def _first_rows(first: dict) -> list:
    r = lambda x: f"{x:.2f}"  # noqa: E731
    return [[f"first async_save blocking vs save, {v.replace('_', ' ')} (second)",
             f"{first[v]['first_blocking_seconds']:.3f} s vs {first[v]['save_seconds']:.3f} s",
             f"{r(first[v]['ratio_first_blocking_vs_save'])} ({r(first[v]['ratio_second_blocking_vs_save'])})"]
            for v in FIRST_VARIANTS if v in first]


def _first_async(ranks: int, rows: int, cols: int, ntensors: int, root: Path, wait: float) -> dict:
    """`_first_async_ranks` (one launch, every variant)."""
    (root / "first").mkdir()
    per_rank, _ = spawn_gloo(_first_async_ranks, (ranks, rows, cols, ntensors, str(root / "first"), wait), ranks,
                             str(root / "first.json"))
    return _first_figures(per_rank)


def _async_figures(ranks: list, total: int) -> dict:
    """The async figures: slowest rank's times (blocking, total), mean step times over the ranks."""
    slowest = {k: max(r[k] for r in ranks) for k in ("save", "async_blocking", "async_total", "dcp_blocking",
                                                     "dcp_total", "async_first_call_total")}
    mean = {k: statistics.mean(r[k] for r in ranks) for k in ("step_idle", "step_during_async", "step_during_dcp",
                                                              "async_background", "dcp_background")}
    return {
        "save_seconds": slowest["save"], "async_blocking_seconds": slowest["async_blocking"],
        "async_total_seconds": slowest["async_total"], "dcp_blocking_seconds": slowest["dcp_blocking"],
        "dcp_total_seconds": slowest["dcp_total"], "async_first_call_total_seconds": slowest["async_first_call_total"],
        "ratio_async_blocking_vs_save": slowest["async_blocking"] / slowest["save"],
        "ratio_async_blocking_vs_dcp_blocking": slowest["async_blocking"] / slowest["dcp_blocking"],
        "ratio_async_total_vs_save": slowest["async_total"] / slowest["save"],
        "ratio_async_total_vs_dcp_total": slowest["async_total"] / slowest["dcp_total"],
        "async_blocking_GBps": total / slowest["async_blocking"] / 1e9,
        "step_idle_seconds": mean["step_idle"], "step_during_async_seconds": mean["step_during_async"],
        "step_during_dcp_seconds": mean["step_during_dcp"],
        "ratio_step_during_async_vs_idle": mean["step_during_async"] / mean["step_idle"],
        "ratio_step_during_dcp_vs_idle": mean["step_during_dcp"] / mean["step_idle"],
        "async_background_seconds": mean["async_background"], "dcp_background_seconds": mean["dcp_background"],
        "note": "blocking: until the call returns (slowest rank, barriers around it); total: until committed "
                "(async_save) or the future is done (DCP, thread-based, its default); steps: timed right after "
                "the call returned, while the save runs in the background (see *_background_seconds)",
        "per_rank": ranks,
    }


def _async_rows(a: dict) -> list:
    r = lambda x: f"{x:.2f}"  # noqa: E731
    return [["async_save blocking vs save (target <= 0.15)", f"{a['async_blocking_seconds']:.3f} s",
             r(a["ratio_async_blocking_vs_save"])],
            ["async_save blocking vs DCP async_save blocking (target <= 1.0)", f"{a['dcp_blocking_seconds']:.3f} s",
             r(a["ratio_async_blocking_vs_dcp_blocking"])],
            ["async_save committed vs save | DCP async_save finished", f"{a['async_total_seconds']:.3f} s",
             f"{r(a['ratio_async_total_vs_save'])} | {r(a['ratio_async_total_vs_dcp_total'])}"],
            ["training step during async_save | DCP async_save vs none", f"{a['step_idle_seconds'] * 1e3:.1f} ms",
             f"{r(a['ratio_step_during_async_vs_idle'])} | {r(a['ratio_step_during_dcp_vs_idle'])}"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=2.0, help="model size in GiB (float32)")
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3, help="runs of each measurement (medians are reported)")
    ap.add_argument("--workdir", default=None, help="where the checkpoints go (default: a temporary directory)")
    ap.add_argument("--hash-mib", type=int, default=256, help="buffer of the one-core hash rates, MiB")
    ap.add_argument("--steps", type=int, default=20, help="training steps timed during each background save")
    ap.add_argument("--first-wait", type=float, default=3.0,
                    help="seconds between the timed save and the first async_save (training would run there)")
    ap.add_argument("--only", choices=("all", "merge", "async"), default="all",
                    help="merge: save once, then time merge against cp only (results: ckpt_merge.json); async: "
                         "the async section alone (results: ckpt_async.json)")
    ap.add_argument("--out", default=None, help="results file (default: bench/results/ckpt.json, or "
                                                "ckpt_merge.json / ckpt_async.json with --only)")
    args = parse_args(ap, {"gib": 0.004, "tensors": 2, "ranks": 2, "repeat": 1, "hash_mib": 4, "steps": 2,
                           "first_wait": 0.0}, "ckpt.json")
    if args.out is None:
        args.out = str(Path(__file__).resolve().parent / "results" /
                       {"merge": "ckpt_merge.json", "async": "ckpt_async.json"}.get(args.only, "ckpt.json"))
    cols = 4096
    rows = int(args.gib * 2**30 / 4 / args.tensors / cols) // args.ranks * args.ranks
    tensor_bytes = rows * cols * 4
    total = tensor_bytes * args.tensors
    load_before = loadavg()  # I/O and hashing figures swing with what else the machine runs
    rates = hash_rates(args.hash_mib * 2**20)
    root = Path(tempfile.mkdtemp(prefix="nnscaler-bench-ckpt-", dir=args.workdir))
    (root / "async").mkdir()
    per_rank = async_ranks = merge = None
    try:
        if args.only == "merge":
            spawn_gloo(_save_once, (args.ranks, rows, cols, args.tensors, str(root)), args.ranks,
                       str(root / "result.json"))
        elif args.only == "all":
            per_rank, _ = spawn_gloo(_ranks, (args.ranks, rows, cols, args.tensors, str(root), args.repeat),
                                     args.ranks, str(root / "result.json"))
        if args.only in ("all", "async"):
            async_ranks, _ = spawn_gloo(_async_ranks, (args.ranks, rows, cols, args.tensors, str(root / "async"),
                                                       args.repeat, args.steps), args.ranks, str(root / "async.json"))
            first = _first_async(args.ranks, rows, cols, args.tensors, root, args.first_wait)
        if args.only != "async":
            merge = _merge_figures(root, total, tensor_bytes, rates, args.repeat)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    header = {**run_header(), "loadavg": {"before": load_before, "after": loadavg()},
              "config": {"gib": args.gib, "tensors": args.tensors, "ranks": args.ranks, "tensor_shape": [rows, cols],
                         "bytes": total, "largest_tensor_bytes": tensor_bytes},
              "rates_one_core": rates}
    r = lambda x: f"{x:.2f}"  # noqa: E731
    summary = (f"{fmt_bytes(total)} in {args.tensors} tensors over {args.ranks} ranks; one core: SHA-256 "
               f"{rates['sha256_GBps']:.2f} GB/s, CRC-32 {rates['crc32_GBps']:.2f} GB/s")
    if merge is not None:
        summary += f"; merge floor {r(merge['ratio_floor_vs_cp'])} x cp"
    if args.only == "merge":
        print(summary)
        print(table(["what", "throughput", "ratio to reference"], _merge_rows(merge, tensor_bytes)))
        save_results(args.out, {**header, "merge": merge})
        return
    if args.only == "async":
        result = {**header, "async": {**_async_figures(async_ranks, total), "first": first}}
        print(summary)
        print(table(["what", "measured", "ratio to reference"], _async_rows(result["async"]) + _first_rows(first)))
        save_results(args.out, result)
        return
    gbs = lambda s: total / s / 1e9  # noqa: E731
    cores = cpu_count()
    slowest = {k: max(x[k] for x in per_rank) for k in ("save", "save_after_commit", "save_file", "save_file_fsync",
                                                         "load", "load_sha256", "load_no_verify", "load_file")}
    # the fast load check adds a CRC-32 pass over every byte, spread over the cores, to what load_file does
    load_floor = slowest["load_file"] + total / (rates["crc32_GBps"] * 1e9 * cores)
    result = {
        **header,
        "save": {"seconds": slowest["save"], "GBps": gbs(slowest["save"]),
                 "ref_save_file_seconds": slowest["save_file"], "ratio_vs_save_file": slowest["save_file"] /
                 slowest["save"], "ref_save_file_fsync_seconds": slowest["save_file_fsync"],
                 "ratio_vs_save_file_fsync": slowest["save_file_fsync"] / slowest["save"],
                 "after_commit_seconds": slowest["save_after_commit"],
                 "after_commit_note": "rank 0's thread after save returned: SHA-256 of the rank files into the "
                                      "manifest, deletion of the replaced checkpoint (save returns before it)"},
        "load": {"seconds": slowest["load"], "GBps": gbs(slowest["load"]), "verify": "fast",
                 "seconds_sha256": slowest["load_sha256"], "seconds_no_verify": slowest["load_no_verify"],
                 "ref_load_file_seconds": slowest["load_file"],
                 "ratio_vs_load_file": slowest["load_file"] / slowest["load"],
                 "ratio_vs_load_file_sha256": slowest["load_file"] / slowest["load_sha256"],
                 "ratio_vs_load_file_no_verify": slowest["load_file"] / slowest["load_no_verify"],
                 "floor_fast_seconds": load_floor, "floor_fast_note": "load_file + bytes / (CRC-32 rate x cores)",
                 "ratio_floor_fast_vs_load_file": slowest["load_file"] / load_floor,
                 "ratio_vs_floor_fast": load_floor / slowest["load"],
                 "exact": all(x["exact"] for x in per_rank)},
        "merge": merge,
        "per_rank": per_rank,
        "async": {**_async_figures(async_ranks, total), "first": first},
    }
    rows_ = [["save vs save_file", f"{result['save']['GBps']:.2f} GB/s", r(result['save']['ratio_vs_save_file'])],
             ["save vs save_file + fsync", f"{result['save']['GBps']:.2f} GB/s",
              r(result['save']['ratio_vs_save_file_fsync'])],
             ["load (fast check) vs load_file", f"{result['load']['GBps']:.2f} GB/s",
              f"{r(result['load']['ratio_vs_load_file'])} (floor {r(result['load']['ratio_floor_fast_vs_load_file'])})"],
             ["load (SHA-256) vs load_file", f"{gbs(slowest['load_sha256']):.2f} GB/s",
              r(result["load"]["ratio_vs_load_file_sha256"])],
             ["load (size only) vs load_file", f"{gbs(slowest['load_no_verify']):.2f} GB/s",
              r(result["load"]["ratio_vs_load_file_no_verify"])]]
    rows_ += _merge_rows(merge, tensor_bytes)
    rows_ += _async_rows(result["async"]) + _first_rows(first)
    print(summary)
    print(table(["what", "throughput", "ratio to reference"], rows_))
    save_results(args.out, result)

if __name__ == "__main__":
    main()
