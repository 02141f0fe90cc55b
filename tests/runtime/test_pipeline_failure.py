"""A stage that fails in the middle of a step (2 gloo processes, pp 2, 1f1b): the failing rank
raises its own error, the other rank raises at once instead of waiting for a message that will
never come (the failed rank sends a failure notice in place of it), and neither runs another step
(the messages are out of step). Both processes stay alive until both are done (a barrier), so
without the notice the other rank would wait until the test's timeout.

A stage killed outright (SIGKILL) sends nothing: its peer must raise the `PeerFailedError` that
data parallelism raises ("rank 1 died"), not gloo's "Connection closed by peer" / "Connection
reset by peer" (pipeline/p2p.py)."""
from __future__ import annotations

import json
import os
import signal

import pytest
import torch

from gpt import GPT, GPTConfig, random_batch
from launch import WorkerError, error_of, run_workers

NMICROS = 4
GPT_CFG = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)


def _micros(step, bad_micro=None):
    micros = [random_batch(step * NMICROS + i, 2, GPT_CFG) for i in range(NMICROS)]
    if bad_micro is not None:  # a label past the vocabulary: the loss (last stage) fails
        micros[bad_micro]["targets"] = micros[bad_micro]["targets"].clone().fill_(99)
    return micros


def work(rank, world, gen_dir):
    from nnscaler import ComputeConfig, parallelize

    torch.manual_seed(0)
    cfg = ComputeConfig(2, 2, trace_strategy="cpu", use_end2end=True,
                        pas_config={"pipeline_nmicros": NMICROS, "pipeline_scheduler": "1f1b"})
    pm = parallelize(GPT(GPT_CFG), _micros(0)[0], "pp", cfg, gen_savedir=gen_dir)
    ok = error_of(lambda: pm.train_step(_micros(0)))
    failed = error_of(lambda: pm.train_step(_micros(1, bad_micro=2)))
    after = error_of(lambda: pm.train_step(_micros(2)))
    import torch.distributed as dist
    dist.barrier()  # both processes stay alive until both are done: a rank left waiting would hang here
    return dict(ok=ok, failed=failed, after=after)


@pytest.mark.multiprocess
def test_a_failing_stage_fails_the_step_on_every_rank(tmp_path):
    first, last = run_workers(work, 2, str(tmp_path / "gen"), timeout=60)
    assert first["ok"] is None and last["ok"] is None
    ours, kind, msg = last["failed"]  # the last stage computes the loss: its own error
    assert not ours and "out of bounds" in msg, (kind, msg)
    ours, kind, msg = first["failed"]  # the first stage: told, not left waiting
    assert ours and "pipeline rank 1 failed in stage 1, micro-batch 2" in msg and "train_step" in msg, msg
    for rank, result in enumerate((first, last)):
        ours, kind, msg = result["after"]
        assert ours and "an earlier step failed" in msg and "restart" in msg, (rank, msg)


def kill_work(rank, world, gen_dir, where):
    """Rank 1 (the last stage) is SIGKILLed before or during the second step; rank 0 writes what
    it raised (its worker returns nothing: the run fails for the dead rank)."""
    from nnscaler import ComputeConfig, parallelize
    from nnscaler.runtime import PeerFailedError

    torch.manual_seed(0)
    cfg = ComputeConfig(2, 2, trace_strategy="cpu", use_end2end=True,
                        pas_config={"pipeline_nmicros": NMICROS, "pipeline_scheduler": "1f1b"})
    pm = parallelize(GPT(GPT_CFG), _micros(0)[0], "pp", cfg, gen_savedir=gen_dir)
    pm.train_step(_micros(0))
    if rank == 1:
        if where == "between_steps":
            os.kill(os.getpid(), signal.SIGKILL)
        real = pm._stage_1

        def stage_1(*args, **kwargs):  # killed in the middle of the step: in its second micro-batch
            stage_1.calls += 1
            if stage_1.calls == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*args, **kwargs)
        stage_1.calls = 0
        pm._stage_1 = stage_1
    out = {"error": None}
    try:
        pm.train_step(_micros(1))
    except PeerFailedError as exc:
        out = {"error": type(exc).__name__, "message": str(exc), "rank": exc.rank, "died": exc.died}
    except Exception as exc:  # noqa: BLE001 - reported for the test to show
        out = {"error": type(exc).__name__, "message": str(exc)}
    with open(os.path.join(gen_dir, f"kill_rank{rank}.json"), "w") as f:
        json.dump(out, f)
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("where", ["between_steps", "mid_step"])
def test_a_killed_stage_is_named_like_a_killed_data_parallel_rank(where, tmp_path):
    gen = tmp_path / "gen"
    with pytest.raises(WorkerError) as info:
        run_workers(kill_work, 2, str(gen), where, timeout=120)
    assert "rank 1 died with exit code -9" in str(info.value) and "--- rank 0 ---" not in str(info.value)
    out = json.loads((gen / "kill_rank0.json").read_text())
    print("rank 0 raised:", out)
    assert out["error"] == "PeerFailedError" and out["rank"] == 1 and out["died"], out
    msg = out["message"]
    assert "rank 1 died" in msg and "the pipeline's" in msg, msg
    assert "Connection" not in msg and "GLHF" not in msg, msg
