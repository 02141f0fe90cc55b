#!/usr/bin/env python
"""The compatibility matrix (issue 45 §2): run its cases, write bench/results/matrix.json, generate
docs/compatibility.md.

    python tools/matrix.py                         # every case not yet recorded (resumable)
    python tools/matrix.py --model llama --plan cp # a filter (any axis: --zero 3 --precision fp64 ...)
    python tools/matrix.py --jobs 2                # cases in parallel (each is 2 or 4 processes)
    python tools/matrix.py --list                  # the cases a filter selects, without running
    python tools/matrix.py --ci                    # CI's fixed sample (matrix_sample.py), batched
    python tools/matrix.py --batched --model gpt2  # many cases per process launch (matrix_batch.py)
    python tools/matrix.py --docs                  # docs/compatibility.md from matrix.json

Each finished case is written to the results file at once (atomically), so an interrupted run
resumes where it stopped; `--rerun` runs recorded cases again. The cases are
`matrix_cases.generate()`; a case runs as `matrix_run.run_case` says (under a deadline).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import matrix_cases  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results", "matrix.json")
DOCS = os.path.join(ROOT, "docs", "compatibility.md")


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def uncommitted() -> list:
    """Files under packages/ that differ from the commit (a run in a shared checkout may see others'
    work in progress: recorded with the results)."""
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--", "packages"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return []
    return sorted(line[3:] for line in out.splitlines() if line.strip())


def load_results(path: str) -> dict:
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    return {"seed": matrix_cases.SEED, "cases": {}}


def write_results(path: str, results: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(results, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def pending(cases, results: dict, rerun: bool):
    """The cases still to run: those without a record (all of them with `rerun`)."""
    done = results.get("cases", {})
    return [c for c in cases if rerun or c["id"] not in done]


def _bar(done: int, total: int, width: int = 30) -> str:
    filled = int(width * done / max(total, 1))
    return f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total}"


def _open(path: str) -> dict:
    results = load_results(path)
    if results.get("seed", matrix_cases.SEED) != matrix_cases.SEED:
        raise SystemExit(f"{path} was made with seed {results['seed']}, the cases now use {matrix_cases.SEED}: "
                         f"move it away or pass another --results")
    return results


def _store(path: str, results: dict, case: dict, record: dict) -> None:
    record["case"] = {a: case[a] for a in matrix_cases.AXES}
    if case.get("base_of"):
        record["base_of"] = case["base_of"]
    results.setdefault("cases", {})[case["id"]] = record
    record.setdefault("commit", commit())
    if uncommitted():
        record.setdefault("uncommitted", uncommitted())
    results.update(seed=matrix_cases.SEED, commit=commit(),
                   date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
    write_results(path, results)


def _line(done: int, total: int, start: float, case: dict, record: dict) -> str:
    eta = (time.monotonic() - start) / done * (total - done)
    return (f"{_bar(done, total)} eta {eta / 60:.0f} min  {record['state']:8s} {case['id']}"
            + (f"  -- {record.get('error', '')[:120]}" if record["state"] != "parity" else ""))


def run_batched(cases, path: str, rerun: bool = False, out=sys.stdout) -> dict:
    """Run the pending `cases` many per process launch (`matrix_batch.run_batch`), recording each
    into `path` as its launch ends. No baseline rerun of a refused option here (`run` does it); a refused
    option's record keeps the link to its baseline's record when that is there."""
    from matrix_batch import run_batch
    results = _open(path)
    todo = pending(cases, results, rerun)
    total, done, start = len(todo), 0, time.monotonic()
    print(f"{len(cases)} case(s) selected, {total} to run ({len(cases) - total} already recorded), "
          f"batched", file=out)

    def on_record(case, record):
        nonlocal done
        done += 1
        base = matrix_cases.baseline_for(case, record.get("error", "")) if record["state"] == "refused" else None
        if base is not None and base["id"] in results.get("cases", {}):
            record["baseline"] = base["id"]
        _store(path, results, case, record)
        print(_line(done, total, start, case, record), file=out, flush=True)
    run_batch(todo, on_record)
    print(f"ran {total} case(s) in {time.monotonic() - start:.0f} s", file=out)
    return results


def run(cases, path: str, jobs: int = 1, rerun: bool = False, runner=None, out=sys.stdout) -> dict:
    """Run the pending `cases`, `jobs` at a time, recording each into `path` as it ends."""
    if runner is None:
        from matrix_run import run_case as runner
    results = _open(path)
    todo = pending(cases, results, rerun)
    lock = threading.Lock()
    total, done, start = len(todo), 0, time.monotonic()
    print(f"{len(cases)} case(s) selected, {total} to run ({len(cases) - total} already recorded)", file=out)
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = {pool.submit(runner, case): case for case in todo}
        while futures:
            future = next(as_completed(futures))
            case = futures.pop(future)
            try:
                record = future.result()
            except Exception as exc:  # noqa: BLE001 - the harness itself failed on this case: recorded
                record = {"state": "crash", "error": f"harness: {type(exc).__name__}: {exc}".splitlines()[0]}
            base = matrix_cases.baseline_for(case, record.get("error", "")) if record["state"] == "refused" else None
            if base is not None and (rerun or base["id"] not in results.get("cases", {})):
                record["baseline"] = base["id"]
                futures[pool.submit(runner, base)] = base
                total += 1
            with lock:
                done += 1
                _store(path, results, case, record)
                print(_line(done, total, start, case, record), file=out, flush=True)
    return results


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    for axis, values in matrix_cases.AXES.items():
        p.add_argument(f"--{axis.replace('_', '-')}", dest=axis, action="append", default=[],
                       help=f"only these values (repeat or comma-separate): {', '.join(values)}")
    p.add_argument("--jobs", type=int, default=1, help="cases run at once (default 1; each is 2 or 4 processes)")
    p.add_argument("--rerun", action="store_true", help="also run cases that already have a record")
    p.add_argument("--list", action="store_true", help="print the selected cases and exit")
    p.add_argument("--ci", action="store_true",
                   help="only CI's fixed sample (matrix_sample.ci_sample, from the default results file), batched")
    p.add_argument("--batched", action="store_true", help="run many cases per process launch (matrix_batch.py)")
    p.add_argument("--docs", action="store_true", help="only generate docs/compatibility.md from the results")
    p.add_argument("--results", default=RESULTS, help=f"results file (default {os.path.relpath(RESULTS, ROOT)})")
    p.add_argument("--docs-path", default=DOCS, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    import matrix_docs
    if args.docs:
        with open(args.docs_path, "w") as f:
            f.write(matrix_docs.render(load_results(args.results)))
        print(f"wrote {args.docs_path}")
        return 0
    filters = {a: [v for item in getattr(args, a) for v in item.split(",") if v] for a in matrix_cases.AXES}
    try:
        everything = matrix_cases.generate()
        if args.ci:
            import matrix_sample
            everything = matrix_sample.ci_sample(load_results(RESULTS).get("cases", {}), everything)
        cases = matrix_cases.select(everything, filters)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.list:
        for case in cases:
            print(case["id"])
        return 0
    if args.ci or args.batched:
        results = run_batched(cases, args.results, rerun=args.rerun)
    else:
        results = run(cases, args.results, jobs=args.jobs, rerun=args.rerun)
    states = {}
    for case in cases:
        state = results["cases"][case["id"]]["state"]
        states[state] = states.get(state, 0) + 1
    print("states:", ", ".join(f"{s} {n}" for s, n in sorted(states.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
