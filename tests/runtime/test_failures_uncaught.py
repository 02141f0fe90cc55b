"""A rank whose process ends by an uncaught exception is named, with its error, by its peers
(runtime/failures/uncaught.py), on 2 real gloo processes started as plain ``python`` processes (as
torchrun starts them: the interpreter's ``sys.excepthook`` runs). The hook is installed by building
a ParallelModule, or (before `parallelize`) by the script's `failures.install_excepthook()`.

Rank 1 raises in the user's own code, outside nnscaler's steps: between forward and backward
(rank 0 waits in the gradient all-reduce), between two pipeline steps (rank 0 waits in a pipeline
receive), before `parallelize` (rank 0 waits in its agreement). Rank 0 must raise
`PeerFailedError` saying that rank 1 raised that error at that line of the script, not that it
"died ... killed, e.g. by SIGKILL" (as before) nor gloo's "Connection closed by peer".

    python -m pytest -q tests/runtime/test_failures_uncaught.py   # ~1 min on 2 cores
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

ENTRY = Path(__file__).with_name("uncaught_entry.py")
ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 150


def _launch(scenario: str, tmp_path: Path):
    """Both ranks as plain python processes on a store this process hosts; (rank 0's outcome,
    rank 1's exit code, both outputs). Every process is killed (its session) on the way out."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, timeout=timedelta(seconds=TIMEOUT_S),
                          wait_for_workers=False)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    path = os.pathsep.join([str(ENTRY.parent), str(ROOT / "examples"), os.environ.get("PYTHONPATH", "")])
    procs = []
    try:
        for rank in range(2):
            env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), RANK=str(rank),
                       WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1",
                       TORCHELASTIC_USE_AGENT_STORE="True", PYTHONPATH=path)  # the store is ours, as torchrun's
            procs.append(subprocess.Popen([sys.executable, str(ENTRY), scenario, str(tmp_path / "gen"), str(out_dir)],
                                          env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          start_new_session=True))
        deadline = time.monotonic() + TIMEOUT_S
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        logs = [p.communicate()[0].decode(errors="replace")[-4000:] for p in procs]
        del store
    result = out_dir / "rank0.json"
    assert result.exists(), f"rank 0 wrote no outcome (a hang, or it crashed):\n" + "\n".join(logs)
    return json.loads(result.read_text()), procs[1].returncode, logs


def _raise_line(scenario: str) -> int:
    lines = ENTRY.read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if line.rstrip().endswith(f"# RAISES {scenario}"))


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("scenario,error,waiting_in", [
    ("dp_between", "RuntimeError: the user's loop failed between forward and backward",
     "data-parallel gradient all-reduce"),
    ("pp_between", "RuntimeError: the user's loop failed between two pipeline steps", "the pipeline's"),
    ("before_parallelize", "ValueError: the data shard of this rank could not be read",
     "parallelize()'s agreement"),
])
def test_a_rank_ended_by_an_uncaught_exception_is_named_with_it(scenario, error, waiting_in, tmp_path):
    out, code, logs = _launch(scenario, tmp_path)
    assert code == 1, f"rank 1 should end by its exception:\n{logs[1]}"
    assert error in logs[1]  # its own traceback is printed as before
    print("rank 0:", out)
    assert out["error"] == "PeerFailedError", (out, logs[0])
    msg = out["message"]
    assert out["rank"] == 1 and not out["died"], out
    assert f"rank 1 raised {error} at {ENTRY}:{_raise_line(scenario)}" in msg, msg
    assert "uncaught" in msg and waiting_in in msg, msg
    assert "SIGKILL" not in msg and "Connection" not in msg, msg
