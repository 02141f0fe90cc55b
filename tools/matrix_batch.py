"""Many matrix cases per process launch (issue 45 §2, CI's sample): one `run_workers` launch per
world size and model runs that model's cases in sequence, instead of one launch per case.

Why per model, not one launch per world size: in a first run of CI's sample as one launch per
world size (141 cases, load average 20 to 29 on the 2 cores), eight float64 cases (Mixtral,
Qwen3-MoE, gpt-oss, ViT) ended 2e-9 to 9e-8 off one process, past the 1e-9 bound, all parity in
the full matrix's runs (a launch per case); Mixtral's and Qwen3-MoE's were parity again alone and
in a launch of their model's cases, and Mixtral's after the same 29 cases of other models in one
launch (load 8 to 10). So
what caused it is not established: it may be process state a case inherits, or timing under
load (an order of summation that depends on it). A launch per model keeps what a case can
inherit to its own model's earlier cases, at little cost: the launches are forked from the fork
server, each in well under a second.

On every rank, each case runs as `matrix_run._train` runs it alone (its own generated code under
its own directory, its own model, optimizer and data), then the ranks meet at a barrier before
the next case. The process groups stay up between cases: the default group, and nnscaler's
subgroups, which `nnscaler.runtime.grid` caches by rank tuple (so a case reuses the groups an
earlier case of the same ranks made); the launch tears them down at its end, as any launch.

Each case writes its ranks' results to its own directory as it ends, so what finished before a
failure is kept. A case that raises on a rank is a ``crash``: that launch ends (the other ranks
may be inside a collective of that case), and the cases after it run in a fresh launch. A case
past its deadline (`matrix_run.DEADLINE`) is a ``hang``: every rank's faulthandler dumps its
Python stacks into the case's directory and exits, and the cases after it run in a fresh launch.
The one-process reference of each case that trained runs here, in the calling process, as
`matrix_run.run_case` runs it; the records are the ones `run_case` gives.
"""
from __future__ import annotations

import faulthandler
import gc
import os
import tempfile
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence

import matrix_run  # noqa: E402  (puts tests/models and tests/runtime on sys.path)
from matrix_cases import PLANS  # noqa: E402

import torch  # noqa: E402


def _case_dir(root: str, i: int) -> str:
    return os.path.join(root, f"case{i}")


def run_rank_cases(rank: int, world: int, cases: Sequence[dict], root: str) -> int:
    """Rank `rank`'s part of every case of `cases`, in order; returns how many ran."""
    import torch.distributed as dist
    for i, case in enumerate(cases):
        where = _case_dir(root, i)
        os.makedirs(where, exist_ok=True)
        start = time.monotonic()
        with open(os.path.join(where, f"stacks.{rank}.txt"), "w") as stacks:
            # past the deadline: dump this rank's stacks and exit (the launch then fails on this case)
            faulthandler.dump_traceback_later(matrix_run.DEADLINE[world] - 8, exit=True, file=stacks)
            try:
                result = matrix_run._train(rank, world, case, where)
            finally:
                faulthandler.cancel_dump_traceback_later()
        result["worker_seconds"] = time.monotonic() - start
        tmp = os.path.join(where, f"result.{rank}.tmp")
        torch.save(result, tmp)
        os.replace(tmp, os.path.join(where, f"result.{rank}.pt"))
        del result
        gc.collect()
        dist.barrier()
    return len(cases)


def _results(where: str, world: int) -> Optional[List[dict]]:
    paths = [os.path.join(where, f"result.{r}.pt") for r in range(world)]
    if not all(os.path.exists(p) for p in paths):
        return None
    return [torch.load(p, weights_only=False) for p in paths]


def _record(case: dict, results: List[dict]) -> dict:
    """The record of a case every rank finished (as `matrix_run.run_case` makes it)."""
    start = time.monotonic()
    refused = [r["error"] for r in results if r["state"] == "refused"]
    if refused:
        record = {"state": "refused", "error": refused[0].splitlines()[0]}
    else:
        try:
            diff = matrix_run.compare(case, results, matrix_run.reference(case))
        except Exception as exc:  # noqa: BLE001 - the reference itself failed: recorded
            diff = f"reference failed: {type(exc).__name__}: {exc}".splitlines()[0]
        record = {"state": "differs", "error": diff} if diff else {"state": "parity"}
    seconds = max(r.get("worker_seconds", 0.0) for r in results) + time.monotonic() - start
    return dict(record, seconds=round(seconds, 1))


def _failure(where: str, world: int, text: str) -> dict:
    """The record of the case a launch failed on: a hang when a rank's deadline dumped its stacks."""
    stacks = {}
    for r in range(world):
        try:
            with open(os.path.join(where, f"stacks.{r}.txt")) as f:
                stacks[str(r)] = f.read()[-3000:]
        except OSError:
            stacks[str(r)] = ""
    if "timed out after" in text or any(s.strip() for s in stacks.values()):
        return {"state": "hang", "error": f"past the deadline of {matrix_run.DEADLINE[world]} s", "stacks": stacks}
    return {"state": "crash", "error": matrix_run._first_error(text), "details": text[-4000:]}


def _launch(world: int, todo: Sequence[dict], root: str, on_done: Callable[[int, List[dict]], None]):
    """One launch running `todo`; `on_done(i, results)` for each case every rank finished, in
    order, while the launch goes on (the reference of a case runs while the ranks run the next
    ones). Returns (how many finished, the launch's error text or None)."""
    from launch import WorkerError, run_workers
    box: Dict[str, str] = {}

    def launch():
        try:
            run_workers(run_rank_cases, world, list(todo), root, timeout=matrix_run.DEADLINE[world] * len(todo))
        except WorkerError as exc:
            box["error"] = str(exc)
        except BaseException as exc:  # noqa: BLE001 - the launcher itself failed: the case's record says so
            box["error"] = f"launcher: {type(exc).__name__}: {exc}"
    thread = threading.Thread(target=launch, name="matrix-batch-launch", daemon=True)
    thread.start()
    i = 0
    while i < len(todo):
        alive = thread.is_alive()
        results = _results(_case_dir(root, i), world)
        if results is not None:
            on_done(i, results)
            i += 1
        elif not alive:
            break
        else:
            thread.join(0.2)
    thread.join()
    return i, box.get("error")


def run_batch(cases: Sequence[dict], on_record: Callable[[dict, dict], None] = lambda case, record: None
              ) -> Dict[str, dict]:
    """Run `cases`, one launch per world size and model (again after a case fails); returns
    {id: record} and calls `on_record(case, record)` as each record is made."""
    records: Dict[str, dict] = {}
    groups: Dict[tuple, List[dict]] = {}
    for case in cases:
        groups.setdefault((PLANS[case["plan"]][2], case["model"]), []).append(case)
    for (world, _), todo in groups.items():
        while todo:
            with tempfile.TemporaryDirectory(prefix="nnscaler-matrix-batch-") as root:
                last = [time.monotonic()]  # when the last record was made: a failure's seconds count from it

                def done(i, results, todo=todo, last=last):
                    last[0] = time.monotonic()
                    records[todo[i]["id"]] = _record(todo[i], results)
                    on_record(todo[i], records[todo[i]["id"]])
                finished, error = _launch(world, todo, root, done)
                if finished < len(todo):
                    case = todo[finished]
                    record = _failure(_case_dir(root, finished), world, error or "the launch ended early")
                    record["seconds"] = round(time.monotonic() - last[0], 1)
                    records[case["id"]] = record
                    on_record(case, record)
            todo = todo[finished + 1:]
    return records
