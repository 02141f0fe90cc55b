"""What gloo does to the waits of runtime/failures/, on 2 real gloo processes.

A dead peer: rank 1 is SIGKILLed while rank 0 waits in a collective of each kind nnscaler issues
(all-reduce, all-gather, reduce-scatter, all-to-all, broadcast, barrier, the ring's send / recv
waited for with `failures.wait`, the pipeline's blocking receive read by `failures.lost_peer`),
either before rank 1 joins it or in the middle of a 4 MB transfer. gloo's error depends on the
collective and the moment ("Connection closed by peer", "Read error: Connection reset by peer", or
no error at all while it keeps waiting for the dead rank's data); rank 0 must always raise the same
one-line `PeerFailedError`: "rank 1 died ...; this rank stopped waiting for it in <the collective>".
The messages themselves are listed in runtime/failures/backends.py.

A peer whose process is gone while the backend goes on waiting for it is named too (the waits look
at the group's processes about once a second).

A late peer: a send / receive whose peer comes a second late completes (a timed wait on gloo's
point-to-point work would have closed every connection of the process when its slice ended).

Times are printed, not asserted.

    python -m pytest -q -s tests/runtime/test_failures_gloo.py   # ~25 s on 2 cores (workers forked, launch.py)
"""
from __future__ import annotations

import json
import os
import signal
import time
from datetime import timedelta

import pytest
import torch

from launch import WorkerError, run_workers

N = 1 << 20  # floats per tensor (4 MB): a transfer gloo cannot finish in one socket buffer
KINDS = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "barrier", "send_recv",
         "pipeline_recv"]


def _what(kind: str) -> str:
    return f"the test's {kind.replace('_', ' ')}"


def _op(kind: str, rank: int, launch_only: bool = False):
    """This rank's side of one `kind` operation, waited for as nnscaler waits for it (or only
    launched, for the rank about to die in the middle of it)."""
    import torch.distributed as dist
    from nnscaler.runtime import failures

    what, x = _what(kind), torch.ones(N)
    if launch_only:  # no wait: the process dies while the transfer runs
        return {
            "all_reduce": lambda: dist.all_reduce(x, async_op=True),
            "all_gather": lambda: dist.all_gather_into_tensor(torch.empty(2 * N), x, async_op=True),
            "reduce_scatter": lambda: dist.reduce_scatter_tensor(torch.empty(N), torch.ones(2 * N), async_op=True),
            "all_to_all": lambda: dist.all_to_all_single(torch.empty(2 * N), torch.ones(2 * N), async_op=True),
            "broadcast": lambda: dist.broadcast(x, src=1, async_op=True),
            "barrier": lambda: dist.barrier(async_op=True),
            "send_recv": lambda: dist.batch_isend_irecv([dist.P2POp(dist.isend, x, 1 - rank),
                                                         dist.P2POp(dist.irecv, torch.empty(N), 1 - rank)]),
            "pipeline_recv": lambda: dist.isend(x, 0),
        }[kind]()
    if kind == "all_reduce":
        failures.run(dist.all_reduce, x, what=what)
    elif kind == "all_gather":
        failures.run(dist.all_gather_into_tensor, torch.empty(2 * N), x, what=what)
    elif kind == "reduce_scatter":  # gloo runs it inside wait(): waited for on a helper thread
        failures.run(dist.reduce_scatter_tensor, torch.empty(N), torch.ones(2 * N), what=what)
    elif kind == "all_to_all":
        failures.run(dist.all_to_all_single, torch.empty(2 * N), torch.ones(2 * N), what=what)
    elif kind == "broadcast":  # from the rank that dies
        failures.run(dist.broadcast, x, src=1, what=what)
    elif kind == "barrier":
        failures.run(dist.barrier, what=what)
    elif kind == "send_recv":  # as ring attention exchanges its blocks
        buf = torch.empty(N)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, 1 - rank), dist.P2POp(dist.irecv, buf, 1 - rank)])
        for work in works:
            failures.wait(work, what, None, buf)
    elif kind == "pipeline_recv":  # as the pipeline receives: blocking, its error read by lost_peer
        if rank == 1:
            dist.send(x, 0)
            return
        try:
            dist.recv(x, 1)
        except RuntimeError as exc:
            lost = failures.lost_peer(exc, what, ranks=(1,))
            if lost is None:
                raise
            raise lost from None


def _dead_peer_worker(rank, world, kind, when, out_dir):
    from nnscaler.runtime import PeerFailedError, failures

    failures.arm()  # as building a ParallelModule does: peers can tell this process died
    _op(kind, rank)  # once with both alive: the connections are up, as in any step after the first
    if rank == 1:
        if when == "mid_transfer":
            _op(kind, rank, launch_only=True)
            time.sleep(0.01)
        else:  # "waiting": rank 0 waits in the operation by now
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    out, start = {"error": None}, time.monotonic()
    for i in range(3):  # the operation rank 1 died in may complete here: the next one cannot
        try:
            _op(kind, rank)
        except PeerFailedError as exc:
            out = {"error": "PeerFailedError", "message": str(exc), "rank": exc.rank, "died": exc.died, "op": i}
            break
        except Exception as exc:  # noqa: BLE001 - reported for the test to show
            out = {"error": type(exc).__name__, "message": str(exc), "op": i}
            break
    out["elapsed_s"] = time.monotonic() - start
    with open(os.path.join(out_dir, "rank0.json"), "w") as f:
        json.dump(out, f)
    return out


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("when", ["waiting", "mid_transfer"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_dead_peer_is_named_in_every_collective(kind, when, tmp_path):
    with pytest.raises(WorkerError) as info:
        run_workers(_dead_peer_worker, 2, kind, when, str(tmp_path), timeout=120)
    text = str(info.value)
    assert "rank 1 died with exit code -9" in text and "--- rank 0 ---" not in text, text  # rank 0 returned
    out = json.loads((tmp_path / "rank0.json").read_text())
    print(f"{kind} ({when}): raised in operation {out.get('op')} after {out['elapsed_s']:.2f} s:", out.get("message"))
    assert out["error"] == "PeerFailedError", out
    msg = out["message"]
    assert msg.startswith("rank 1 died (its process ended without reporting an error"), msg
    assert msg.endswith(f"this rank stopped waiting for it in {_what(kind)}"), msg
    assert out["rank"] == 1 and out["died"] and "\n" not in msg, out
    assert "Connection" not in msg and "gloo" not in msg, msg


def _late_peer_worker(rank, world):
    import torch.distributed as dist
    from nnscaler.runtime import failures

    failures.arm()
    if rank == 1:
        time.sleep(1.0)  # four slices of the peer's wait
    mine, buf = torch.full((8,), float(rank)), torch.empty(8)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, 1 - rank), dist.P2POp(dist.irecv, buf, 1 - rank)])
    for work in works:
        failures.wait(work, "the test's late exchange", None, buf)
    total = torch.ones(1)
    failures.run(dist.all_reduce, total, what="the test's all-reduce after it")  # the connections still work
    return dict(received=buf.tolist(), total=total.item())


@pytest.mark.multiprocess
def test_a_late_peer_of_a_send_and_receive_is_waited_for():
    results = run_workers(_late_peer_worker, 2, timeout=120)
    for rank, out in enumerate(results):
        assert out["received"] == [float(1 - rank)] * 8 and out["total"] == 2.0, (rank, out)


def _silent_death_worker(rank, world):
    """Rank 1's registered process is one that has ended (a child it ran and reaped) while rank 1
    itself stays out of the all-reduce: to rank 0 it is a peer that died without the backend
    noticing, as a peer killed in the middle of a gloo all-to-all or gather can leave it."""
    import subprocess
    import sys
    import torch.distributed as dist
    from nnscaler.runtime import PeerFailedError, failures
    from nnscaler.runtime.failures import notices

    failures.arm()
    store = dist.distributed_c10d._get_default_store()
    out = {}
    if rank == 1:
        gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
        host = store.get(f"{notices.PREFIX}proc/1").decode().rsplit(" ", 1)[0]
        store.set(f"{notices.PREFIX}proc/1", f"{host} {int(gone.stdout)}")
        store.set("test/registered", "1")
        store.wait(["test/raised"], timedelta(seconds=60))
    else:
        store.wait(["test/registered"], timedelta(seconds=60))
        try:
            failures.run(dist.all_reduce, torch.ones(1), what="the test's all-reduce")
            out["error"] = None
        except PeerFailedError as exc:
            out.update(error=str(exc), rank=exc.rank, died=exc.died)
        store.set("test/raised", "1")
    if rank == 1:  # completes rank 0's all-reduce, still pending in gloo: both leave in step
        dist.all_reduce(torch.ones(1))
        store.set("test/joined", "1")
    else:
        store.wait(["test/joined"], timedelta(seconds=60))
    return out


@pytest.mark.multiprocess
def test_a_peer_that_died_without_the_backend_noticing_is_named():
    out = run_workers(_silent_death_worker, 2, timeout=120)[0]
    assert out["error"] is not None and out["rank"] == 1 and out["died"], out
    assert out["error"].startswith("rank 1 died") and "the test's all-reduce" in out["error"], out
