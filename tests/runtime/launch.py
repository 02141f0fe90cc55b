"""Run a function on N real torch.distributed (gloo) processes and collect what each returns.

    from launch import run_workers
    results = run_workers(fn, 2, arg1, arg2, timeout=120)   # fn(rank, world_size, arg1, arg2)

`fn` must be a module-level function (it is pickled by reference into spawned interpreters) and
its arguments and return value must be picklable with torch.save. Every worker sets
MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, runs with one thread, joins a gloo
group, and always destroys it (and nnscaler's cached groups) on the way out. A worker's exception
fails the call with its traceback text; a worker that dies, or a run that exceeds `timeout`,
fails it too. No process is left behind.

The rendezvous store is hosted by the calling process, as torchrun's agent hosts it: a TCPStore
server bound to a port the OS picks (port 0) *before* any worker starts, kept bound until every
worker is gone; the workers connect to it as clients (MASTER_PORT names it). So no port is
chosen, released and bound again later (the old `free_port()` race: another process could take
the port in between).

The workers are forked from multiprocessing's fork server, which has imported torch, nnscaler's
parts, transformers' models and Lightning once for the whole session (`PRELOAD`): a worker then
starts in a few milliseconds instead of the 1.5 to 3 s a fresh interpreter takes to import them (on
2 cores, a 2-rank launch took 3.2 s before its function ran, a 4-rank one 6 s; Lightning adds 7 s of
CPU a worker). The server imports modules only, runs no torch op and
starts no Python thread, so a forked worker is what a spawned one would be after the same imports
(Lightning's rank aside, which `_worker` sets: Lightning reads it when imported); its
environment is the caller's at the call (passed along, as a spawned child would inherit it), and
its working directory and `sys.path` the caller's, as with spawn. `NNSCALER_TEST_START_METHOD=spawn`
starts fresh interpreters instead.
"""
from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import socket
import sys
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, List

GRACE_S = 10.0  # how long the other ranks get to finish once one has failed
START_METHOD_VAR = "NNSCALER_TEST_START_METHOD"  # "forkserver" (default) or "spawn"
# imported once by the fork server (a module that fails to import is skipped by multiprocessing)
PRELOAD = ["torch", "torch.distributed", "nnscaler.ir", "nnscaler.runtime", "nnscaler.policies", "nnscaler.codegen",
           "nnscaler.ckpt",
           # the Hugging Face models of tests/models (2.7 s a worker to import)
           "transformers", *(f"transformers.models.{m}.modeling_{m}" for m in ("llama", "qwen2", "mixtral", "qwen2_moe",
                                                                              "gpt2", "bert", "resnet", "vit",
                                                                              "deepseek_v3", "gpt_oss")),
           # tests/lightning's workers (7 s of CPU a worker to import); its rank is set in `_worker`
           "lightning.pytorch", "lightning.fabric", "nnscaler.lightning"]


class WorkerError(RuntimeError):
    """One or more workers failed; the message holds their tracebacks."""


def free_port() -> int:
    """A port that was free a moment ago (racy: for launchers such as torchrun that must be given
    a port, with a retry when it was taken; `run_workers` does not use it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dumps(obj: Any) -> bytes:
    import torch
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _context():
    method = os.environ.get(START_METHOD_VAR, "forkserver")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)  # read when the server starts (the first launch)
    return ctx


def _set_lightning_rank(rank: int) -> None:
    """Lightning reads the process's rank from the environment once, when imported (its
    `rank_zero_only.rank`); imported by the fork server, it read none. Set it as an import here,
    with RANK set, would have."""
    rank_zero = sys.modules.get("lightning_utilities.core.rank_zero")
    if rank_zero is not None:
        rank_zero.rank_zero_only.rank = rank


def _worker(fn: Callable, rank: int, world: int, port: int, args: tuple, timeout: float, out, env: dict) -> None:
    if os.environ != env:  # forked from the fork server: the caller's environment, as spawn gives it
        os.environ.clear()
        os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    _set_lightning_rank(rank)
    try:
        import torch
        import torch.distributed as dist
        torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=timeout))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout))
        del store  # the default group holds it
        try:
            result = fn(rank, world, *args)
        finally:
            try:
                from nnscaler.runtime.grid import RankGrid
                RankGrid.destroy_all()
            finally:
                dist.destroy_process_group()
        out.put((rank, True, _dumps(result)))
    except BaseException:
        out.put((rank, False, traceback.format_exc()))


def run_workers(fn: Callable, world_size: int, *args: Any, timeout: float = 120) -> List[Any]:
    """`fn(rank, world_size, *args)` on `world_size` gloo processes; returns the results by rank."""
    import torch
    import torch.distributed as dist
    ctx = _context()
    out = ctx.Queue()
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, timeout=timedelta(seconds=timeout),
                          wait_for_workers=False)
    port = store.port
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, port, args, timeout, out, dict(os.environ)),
                         daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors = {}, {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(errors) < world_size:
            now = time.monotonic()
            if now > deadline:
                errors.setdefault(-1, f"timed out after {timeout}s; ranks without a result: "
                                      f"{sorted(set(range(world_size)) - set(results) - set(errors))}")
                break
            try:
                rank, ok, payload = out.get(timeout=min(0.5, deadline - now + 0.01))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs)
                        if p.exitcode is not None and r not in results and r not in errors]
                if dead:  # died without reporting (crash, signal); let a late report arrive first
                    time.sleep(0.5)
                    if out.empty():
                        for r in dead:
                            errors[r] = f"rank {r} died with exit code {procs[r].exitcode} and no report"
                continue
            if ok:
                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                errors[rank] = payload
                deadline = min(deadline, time.monotonic() + GRACE_S)
    finally:
        for p in procs:
            p.join(timeout=1.0 if errors else 5.0)
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
        out.close()
        out.join_thread()
        del store  # closes the server: every worker is gone
    if errors:
        raise WorkerError("\n".join(f"--- rank {r} ---\n{text}" for r, text in sorted(errors.items())))
    return [results[r] for r in range(world_size)]


# -- single-process fixtures (import them into a test module to use them) ---------------------
import pytest  # noqa: E402


@pytest.fixture
def world1():
    """A real one-rank gloo process group for the duration of a test."""
    import torch.distributed as dist
    from nnscaler.runtime.grid import RankGrid
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # no port at all
    try:
        yield
    finally:
        RankGrid.destroy_all()
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.fixture
def no_leaks():
    """A no-op, kept for a module that still names it: tests/conftest.py checks every test for
    leaked processes, process groups, registry entries and files (no opt-in)."""
    yield


def error_of(fn: Callable[[], Any]):
    """(is an NnScalerError, exception class name, message) of what `fn()` raises; None if it
    returns. For workers: the parent asserts on what every rank reported."""
    from nnscaler.runtime.errors import NnScalerError
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which asserts on it
        return isinstance(exc, NnScalerError), type(exc).__name__, str(exc)
    return None
