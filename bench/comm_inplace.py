"""What in-place safety costs the collectives (runtime/comm), one process, no communication.

    python bench/comm_inplace.py [--reps 200]

Every collective returns a tensor that is not a view, so in-place ops may modify it. Where the
received buffer is reshaped into the output (all-gather along dim 0, all-to-all), `primitives.own`
drops the view-ness without a copy: timed per call against the bare reshape. The one real copy is
`grad_all_reduce`'s forward (its result is the input's value): a clone of the activation, timed
for 1, 4 and 16 MiB against the reference of a plain memory copy of the same size
(``torch.empty_like(x).copy_(x)``) and reported as GB/s. Writes bench/results/comm_inplace.json.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

import torch  # noqa: E402

from nnscaler.runtime.comm.primitives import own  # noqa: E402


def _time(fn, reps: int) -> float:
    for _ in range(5):
        fn()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return _common.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--out", default=str(_common.RESULTS_DIR / "comm_inplace.json"))
    args = _common.parse_args(ap, {"reps": 2}, "comm_inplace.json")
    torch.set_num_threads(1)
    stacked = torch.randn(2, 64, 128)
    reshape = lambda: stacked.reshape(128, 128)  # noqa: E731
    owned = lambda: own(stacked.reshape(128, 128))  # noqa: E731
    t_view, t_own = _time(reshape, args.reps), _time(owned, args.reps)
    rows, clones = [["own() per call", f"{(t_own - t_view) * 1e6:.2f} us over the reshape", "no copy"]], {}
    for mib in (1, 4, 16):
        x = torch.randn(mib * 1024 * 1024 // 4)
        t_clone = _time(lambda: x.clone(memory_format=torch.contiguous_format), args.reps)
        t_copy = _time(lambda: torch.empty_like(x).copy_(x), args.reps)
        clones[mib] = {"clone_s": t_clone, "memcpy_s": t_copy}
        rows.append([f"grad_all_reduce fwd clone {mib} MiB", f"{t_clone * 1e3:.3f} ms "
                     f"({mib / 1024 / t_clone:.1f} GB/s)", f"memcpy {t_copy * 1e3:.3f} ms"])
    print(_common.table(["what", "time", "reference"], rows))
    _common.save_results(args.out, {**_common.run_header(), "reps": args.reps,
                                               "own_s": t_own - t_view, "reshape_s": t_view, "clones": clones})


if __name__ == "__main__":
    main()
