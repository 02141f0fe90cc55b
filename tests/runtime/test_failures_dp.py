"""Failures reach every rank under dp, tp x dp and ZeRO (runtime/failures/), on real gloo processes.

One rank raises inside forward (an op of the generated code fails) or inside backward (a hook on
one of its parameters), catches the error in its own loop and stays alive, waiting (through the
store) until every other rank has raised. So a peer that blocked until the failing process exits
would make the failing rank's wait time out: the test fails instead of passing slowly. Every
other rank must raise `PeerFailedError` naming the failing rank and its message; later steps are
refused everywhere with `StepRefusedError`. A rank killed with SIGKILL mid-step ends its peer with
a message that says which rank died; a rank that fails and exits is named with its error. Times
are returned and printed, not asserted.

    python -m pytest -q -s tests/runtime/test_failures_dp.py   # ~3 min on 2 cores
"""
from __future__ import annotations

import json
import os
import signal
import time
from datetime import timedelta

import pytest
import torch

import toy_models
from launch import WorkerError, run_workers

GLOBAL_BATCH = 8
BOOM = "boom on the failing rank"

# name: (plan_ngpus, runtime_ngpus, policy, extra ComputeConfig fields, failing rank, where)
CASES = {
    "dp_forward": (1, 2, "dp", {}, 1, "forward"),
    "dp_backward": (1, 2, "dp", {}, 1, "backward"),
    "dp_async_backward": (1, 2, "dp", dict(use_async_reducer=True, reducer_bucket_cap_mb=0.001), 1, "backward"),
    "tp_dp_forward": (2, 4, "tp", {}, 1, "forward"),
    "tp_dp_backward": (2, 4, "tp", {}, 1, "backward"),
    "zero_rs_forward": (1, 2, "dp", dict(use_zero=True, zero_use_reduce_scatter=True), 1, "forward"),
    "dp_kill": (1, 2, "dp", {}, 1, "kill"),
    "dp_exit": (1, 2, "dp", {}, 1, "exit"),
}
# the collective a peer was waiting in when it raised (rank -> words of its name)
WAITING_IN = {"dp_forward": {0: "data-parallel gradient all-reduce"},
              "zero_rs_forward": {0: "ZeRO's gradient reduce-scatter"},
              "tp_dp_forward": {0: "tensor-parallel", 3: "data-parallel gradient all-reduce"}}


def _build(rank, world, name, gen_dir):
    from nnscaler import ComputeConfig, build_optimizer, parallelize

    plan, _, policy, extra, _, _ = CASES[name]
    dp = world // plan
    torch.manual_seed(0)
    cfg = ComputeConfig(plan, world, trace_strategy="cpu", **extra)
    pm = parallelize(toy_models.MLP(), toy_models.mlp_batch(0, GLOBAL_BATCH // dp), policy, cfg,
                     gen_savedir=gen_dir, instance_name=name)
    opt = build_optimizer(pm, torch.optim.Adam, lr=1e-3)

    def step(i):
        per, dp_rank = GLOBAL_BATCH // dp, rank // plan
        mine = {k: v[dp_rank * per:(dp_rank + 1) * per] for k, v in toy_models.mlp_batch(i, GLOBAL_BATCH).items()}
        opt.zero_grad()
        loss = pm(**mine)
        loss.backward()
        opt.step()
        return loss.item()

    return pm, step


def _inject(pm, where):
    """Make this rank's next step raise (or die) in `where`."""
    if where in ("forward", "exit"):  # an op of the generated forward fails on this rank only
        real = torch.nn.functional.gelu

        def gelu(*args, **kwargs):
            raise ValueError(BOOM)
        torch.nn.functional.gelu = gelu
        return lambda: setattr(torch.nn.functional, "gelu", real)

    def hook(grad):
        if where == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise ValueError(BOOM)
    handle = next(iter(pm.parameters())).register_hook(hook)  # the first layer: late in backward
    return handle.remove


def _worker(rank, world, name, gen_dir):
    import torch.distributed as dist
    from nnscaler.runtime.failures import PeerFailedError, StepRefusedError

    failing, where = CASES[name][4], CASES[name][5]
    pm, step = _build(rank, world, name, gen_dir)
    store = dist.distributed_c10d._get_default_store()
    step(0)  # a healthy step first
    out = {"rank": rank}
    if rank == failing:
        undo = _inject(pm, where)
        store.set("test/t_fail", repr(time.time()))
        try:
            step(1)
        except ValueError as exc:  # the user's loop catches its own error and stays alive
            out["own_error"] = str(exc)
        undo()
        if where == "exit":  # ... or this rank ends (its error would be uncaught): its process exits
            return out
        # Alive until every peer has raised: a peer blocked until this process exits never sets
        # its key, and this wait times out (the test fails).
        store.wait([f"test/done/{r}" for r in range(world) if r != rank], timedelta(seconds=60))
    else:
        # A rank raises at its first collective that waits on the failed rank: in this step, or in
        # the next one for a rank whose step needed nothing more from it (tp x dp: the other unit).
        out["error"] = None
        for i in (1, 2):
            try:
                step(i)
            except PeerFailedError as exc:
                out["elapsed_s"] = time.time() - float(store.get("test/t_fail").decode())
                out.update(error=str(exc), failed_rank=exc.rank, died=exc.died, step=i)
                break
        store.set(f"test/done/{rank}", "1")
        if where in ("kill", "exit"):
            with open(os.path.join(gen_dir, f"kill_rank{rank}.json"), "w") as f:
                json.dump(out, f)
    try:
        step(3)
        out["refused"] = None
    except StepRefusedError as exc:
        out["refused"] = str(exc)
    return out


def _check_peer(out, failing, message):
    assert out["error"] is not None, f"rank {out['rank']} did not raise"
    assert out["failed_rank"] == failing, out
    assert f"rank {failing}" in out["error"] and message in out["error"], out["error"]


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("name", ["dp_forward", "dp_backward", "dp_async_backward", "zero_rs_forward",
                                  "tp_dp_forward", "tp_dp_backward"])
def test_failure_reaches_every_rank(name, tmp_path):
    plan, world, _, _, failing, where = CASES[name]
    results = run_workers(_worker, world, name, str(tmp_path), timeout=240)
    print({r["rank"]: (r.get("step"), round(r.get("elapsed_s", 0.0), 2)) for r in results})
    for out in results:
        if out["rank"] == failing:
            assert out["own_error"] == BOOM
            assert "an earlier step failed" in out["refused"] and f"rank {failing} failed in {where}" in out["refused"]
            continue
        _check_peer(out, failing, BOOM)
        assert f"failed in {where}" in out["error"] and not out["died"]
        expected = WAITING_IN.get(name, {}).get(out["rank"])
        assert expected is None or expected in out["error"], out["error"]
        assert out["refused"] is not None and f"rank {failing} failed" in out["refused"], out


@pytest.mark.multiprocess
@pytest.mark.slow
def test_killed_rank_ends_its_peer(tmp_path):
    with pytest.raises(WorkerError) as info:
        run_workers(_worker, 2, "dp_kill", str(tmp_path), timeout=240)
    text = str(info.value)
    assert "rank 1 died with exit code -9" in text and "--- rank 0 ---" not in text, text  # rank 0 returned
    with open(tmp_path / "kill_rank0.json") as f:
        out = json.load(f)
    print("rank 0 raised", round(out["elapsed_s"], 2), "s after the kill:", out["error"])
    assert out["failed_rank"] == 1 and out["died"], out
    assert "rank 1 died" in out["error"] and "Connection closed" not in out["error"], out["error"]
    assert "gradient all-reduce" in out["error"]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_rank_that_failed_and_exited_is_named_with_its_error(tmp_path):
    results = run_workers(_worker, 2, "dp_exit", str(tmp_path), timeout=240)
    assert results[1]["own_error"] == BOOM
    out = results[0]
    print("rank 0 raised", round(out["elapsed_s"], 2), "s after the failure:", out["error"])
    _check_peer(out, 1, BOOM)
    assert "failed in forward" in out["error"] and not out["died"], out



def _pipeline_worker(rank, world, gen_dir):
    import torch.distributed as dist
    from gpt import GPT, GPTConfig, random_batch
    from launch import error_of
    from nnscaler import ComputeConfig, parallelize

    gpt_cfg, nmicros = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16), 2

    def micros(step, bad=False):
        out = [random_batch(step * nmicros + i, 2, gpt_cfg) for i in range(nmicros)]
        if bad:  # a label past the vocabulary: the loss (last stage) fails on this unit only
            out[1]["targets"] = out[1]["targets"].clone().fill_(99)
        return out

    torch.manual_seed(0)
    cfg = ComputeConfig(2, world, trace_strategy="cpu", use_end2end=True,
                        pas_config={"pipeline_nmicros": nmicros, "pipeline_scheduler": "1f1b"})
    pm = parallelize(GPT(gpt_cfg), micros(0)[0], "pp", cfg, gen_savedir=gen_dir)
    ok = error_of(lambda: pm.train_step(micros(0)))
    failed = error_of(lambda: pm.train_step(micros(1, bad=rank == 3)))
    dist.barrier()  # every process stays alive until all are done: a rank left waiting hangs here
    return dict(ok=ok, failed=failed)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_pipeline_failure_reaches_the_data_parallel_peers(tmp_path):
    # pp 2 x dp 2: rank 3 (unit 1, last stage) fails; rank 2 hears it through the pipeline's own
    # notice; ranks 0 and 1 (unit 0) finish their pipeline step and would wait in the gradient
    # all-reduce with ranks 2 and 3 for ever without the failure notice.
    results = run_workers(_pipeline_worker, 4, str(tmp_path), timeout=240)
    assert all(r["ok"] is None for r in results)
    assert "out of bounds" in results[3]["failed"][2]
    assert "pipeline rank 3 failed" in results[2]["failed"][2]
    for rank in (0, 1):
        ours, kind, msg = results[rank]["failed"]
        assert kind == "PeerFailedError" and "rank 3 failed in train_step" in msg and "out of bounds" in msg, msg
        assert "data-parallel gradient all-reduce" in msg, msg


STALL_S = 3  # the default group's timeout in the stall test


def _stall_worker(rank, world):
    """Rank 1 raises in its own loop between forward and backward, catches it and stays alive;
    rank 0 waits in the gradient all-reduce until the default group's timeout passes."""
    import torch.distributed as dist
    from nnscaler.runtime import CollectiveTimeoutError, Reducer
    from nnscaler.runtime.grid import default_timeout, process_group

    dist.barrier()  # start-up (paced by the shared CPU) ran under the launcher's long timeout
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=STALL_S))
    groups = [process_group([r]) for r in range(world)]  # collective: every rank makes both
    mine = groups[rank]._get_backend(torch.device("cpu")).options._timeout
    out = {"default_s": default_timeout().total_seconds(), "subgroup_s": mine.total_seconds()}
    store = dist.distributed_c10d._get_default_store()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    reducer = Reducer(model.parameters())
    loss = model(torch.ones(2, 4)).sum()
    if rank == 1:
        try:
            raise ValueError("the user's loss code failed")
        except ValueError:
            pass  # the user's loop logs it and goes on; this process stays alive
        store.wait(["test/stall/rank0"], timedelta(seconds=60))  # until rank 0 has given up
    else:
        try:
            loss.backward()
            out["error"] = None
        except CollectiveTimeoutError as exc:
            out.update(error=str(exc), missing=exc.missing, what=exc.what)
        finally:
            store.set("test/stall/rank0", "1")
    reducer.remove()
    return out


@pytest.mark.multiprocess
def test_a_stalled_rank_is_named_once_the_default_group_timeout_passes():
    results = run_workers(_stall_worker, 2, timeout=120)
    assert [r["default_s"] for r in results] == [STALL_S, STALL_S]
    assert [r["subgroup_s"] for r in results] == [STALL_S, STALL_S]  # grid's groups carry it too
    out = results[0]
    assert out["error"] is not None, "rank 0 did not raise"
    assert out["missing"] == (1,) and "gradient all-reduce" in out["what"], out
    assert "rank 1 did not arrive" in out["error"] and "gradient all-reduce" in out["error"], out["error"]
    assert "init_process_group(timeout=...)" in out["error"] and "collective_timeout" in out["error"]
