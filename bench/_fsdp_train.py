"""bench/fsdp.py part 8 (`--parts train`): what a user sees, `nnscaler train` with and without
`use_zero: 3` (not part of nnscaler; issue 43 §5).

Each case runs ``nnscaler train -f examples/trainer/hf_llama.yaml --nproc N`` as a user would (a
subprocess, the example's tokenizer and data, `--train-steps` (3) steps, the final checkpoint saved),
with the model's ``config.json`` replaced by a larger Llama (default: vocab 512 as the example's
tokenizer, hidden 512, MLP 1408, 10 layers: ~32M parameters, random initial weights from the seed)
and no malloc variable in the environment. Cases: ``unsharded`` (the example's ``dp``), ``zero3``
(``--compute_config.use_zero 3``), and the same two with ``NNSCALER_GLIBC_MALLOC_DEFAULTS=1``
(``-glibc``: the launcher leaves glibc's malloc defaults, as before it set its workers' thresholds).

A thread samples the RSS (``/proc/<pid>/status`` VmRSS, VmHWM) of every process under the
command every 20 ms. A worker's *peak* is its VmHWM (exact); *set-up peak*: the largest RSS sampled
before rank 0 printed its first step line (the build, `parallelize`, the optimizer, the first step);
*training peak*: the largest sampled after it. Per case the larger worker's.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List

import _common

EXAMPLE = _common.REPO_ROOT / "examples" / "trainer"
CASES = ("unsharded", "zero3", "unsharded-glibc", "zero3-glibc")
MALLOC_VARS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES", "NNSCALER_GLIBC_MALLOC_DEFAULTS")


def add_args(p) -> None:
    p.add_argument("--train-cases", nargs="*", default=list(CASES), choices=CASES)
    p.add_argument("--train-nproc", type=int, default=2)
    p.add_argument("--train-hidden", type=int, default=512)
    p.add_argument("--train-mlp", type=int, default=1408)
    p.add_argument("--train-layers", type=int, default=10)
    p.add_argument("--train-heads", type=int, default=8)
    p.add_argument("--train-steps", type=int, default=3)


SMOKE = {"train_cases": ["zero3"], "train_hidden": 64, "train_mlp": 128, "train_layers": 2,
         "train_heads": 4, "train_steps": 1}


def _config_dir(args, path: Path) -> int:
    """The example's config.json with the sizes of `args`, the tokenizer files beside it; the
    parameter count (untied head: the example's config ties it)."""
    cfg = json.loads((EXAMPLE / "hf_llama" / "config.json").read_text())
    cfg.update(hidden_size=args.train_hidden, intermediate_size=args.train_mlp, num_hidden_layers=args.train_layers,
               num_attention_heads=args.train_heads, num_key_value_heads=args.train_heads, tie_word_embeddings=False)
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(EXAMPLE / "hf_llama" / f, path / f)
    h, v, m, n = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    kv = h // cfg["num_attention_heads"] * cfg["num_key_value_heads"]
    return 2 * v * h + h + n * (2 * h * h + 2 * h * kv + 3 * h * m + 2 * h)


def _status(pid: int) -> Dict[str, int]:
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(("VmRSS:", "VmHWM:")):
                out[line.split(":")[0]] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return out


def _descendants(pid: int) -> List[int]:
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                kids = Path(f"/proc/{p}/task/{task}/children").read_text().split()
                todo += [int(k) for k in kids]
                found += [int(k) for k in kids]
        except OSError:
            pass
    return found


class _Watch:
    """Samples every process under `pid`: per pid its last VmHWM and (t, VmRSS) samples."""

    def __init__(self, pid: int, period: float = 0.02):
        self.pid, self.period, self.hwm, self.samples = pid, period, {}, {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop.is_set():
            now = time.perf_counter()
            for p in [self.pid] + _descendants(self.pid):
                st = _status(p)
                if "VmHWM" in st:
                    self.hwm[p] = max(self.hwm.get(p, 0), st["VmHWM"])
                    self.samples.setdefault(p, []).append((now, st["VmRSS"]))
            time.sleep(self.period)

    def close(self):
        self.stop.set()
        self.thread.join()


def run_case(args, case: str, cfg_dir: Path, tmp: Path) -> dict:
    run_dir = tmp / f"train_{case}"
    exe = os.path.join(os.path.dirname(sys.executable), "nnscaler")
    cmd = [exe, "train", "-f", str(EXAMPLE / "hf_llama.yaml"), "--nproc", str(args.train_nproc),
           "--compute_config.runtime_ngpus", str(args.train_nproc), "--vars.run_dir", str(run_dir),
           "--model.args.config", str(cfg_dir), "--max_train_steps", str(args.train_steps),
           "--val_every_n_train_steps", str(10 * args.train_steps), "--enable_progress_bar", "false",
           "--checkpoint.every_n_train_steps", str(args.train_steps)]
    if case.startswith("zero3"):
        cmd += ["--compute_config.use_zero", "3"]
    env = {k: v for k, v in os.environ.items() if k not in MALLOC_VARS}
    if case.endswith("-glibc"):
        env["NNSCALER_GLIBC_MALLOC_DEFAULTS"] = "1"
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=_common.REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    watch = _Watch(proc.pid)
    lines, first_step = [], None
    for line in proc.stdout:
        lines.append(line.rstrip())
        if first_step is None and " step " in line and "/" in line:
            first_step = time.perf_counter()
    rc = proc.wait()
    watch.close()
    seconds = time.perf_counter() - t0
    if rc != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {rc}:\n" + "\n".join(lines[-40:]))
    workers = [p for p in watch.hwm if p != proc.pid]
    per = []
    for p in workers:
        s = watch.samples[p]
        cut = first_step if first_step is not None else float("inf")
        per.append({"pid": p, "peak_rss": watch.hwm[p],
                    "setup_peak_sampled": max((r for t, r in s if t < cut), default=0),
                    "training_peak_sampled": max((r for t, r in s if t >= cut), default=0)})
    per.sort(key=lambda r: -r["peak_rss"])
    return {"case": case, "command": " ".join(cmd), "malloc_env_in_workers": not case.endswith("-glibc"),
            "seconds": seconds, "launcher_peak_rss": watch.hwm.get(proc.pid), "workers": per,
            "peak_rss": per[0]["peak_rss"], "setup_peak": max(r["setup_peak_sampled"] for r in per),
            "training_peak": max(r["training_peak_sampled"] for r in per),
            "step_lines": [x for x in lines if " step " in x][-3:]}


def run(args, tmp: str) -> dict:
    tmp = Path(tmp)
    cfg_dir = tmp / "train_model"
    n_params = _config_dir(args, cfg_dir)
    runs = {}
    for case in args.train_cases:
        runs[case] = run_case(args, case, cfg_dir, tmp)
        print(f"part 8 (nnscaler train) {case}: peak RSS {_common.fmt_mib(runs[case]['peak_rss'])} MiB "
              f"({runs[case]['seconds']:.0f} s)", flush=True)
    ratios = {}
    for suffix in ("", "-glibc"):
        z, u = runs.get("zero3" + suffix), runs.get("unsharded" + suffix)
        if z and u:
            for k in ("peak_rss", "setup_peak", "training_peak"):
                ratios[f"{k} zero3/unsharded{suffix}"] = z[k] / u[k]
    return {"params": n_params, "nproc": args.train_nproc, "steps": args.train_steps, "runs": runs, "ratios": ratios}


def report(s: dict, table, fmt_mib) -> str:
    rows = [[c, fmt_mib(r["peak_rss"]), fmt_mib(r["setup_peak"]), fmt_mib(r["training_peak"]),
             "yes" if r["malloc_env_in_workers"] else "no (glibc defaults)", f"{r['seconds']:.0f}"]
            for c, r in s["runs"].items()]
    out = table(["case", "peak RSS MiB (larger worker)", "set-up peak (sampled)", "training peak (sampled)",
                 "launcher's malloc thresholds", "s"], rows)
    return out + "\n" + "\n".join(f"{k}: {v:.3f}" for k, v in s["ratios"].items())
