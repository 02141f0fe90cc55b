"""Two torchrun "nodes" x 2 processes on this host, each node with its own working directory
(so its own gen_savedir, as machines without shared storage): every `broadcast_strategy`, code
missing on a node, stale code on a node, and a relaunch where the node ranks are swapped.

The workers run tests/runtime/multinode_entry.py (tp 2 x dp 2 on a tiny model, two SGD steps)
and write their outcomes as JSON; the launches are killed (whole process groups) on timeout.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launch import free_port

ENTRY = Path(__file__).with_name("multinode_entry.py")
TIMEOUT_S = 90


def _launch(scenario: str, node_dirs, out: Path):
    """One attempt: (outcomes or None when the launch itself failed to start, log tails)."""
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = []
    try:
        for k, d in enumerate(node_dirs):
            d.mkdir(exist_ok=True)
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(k),
                   "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
                   str(ENTRY), scenario, str(out)]
            procs.append(subprocess.Popen(cmd, cwd=d, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          start_new_session=True))
        deadline, grace = time.monotonic() + TIMEOUT_S, None
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                break
            if len(list(out.glob("rank*.json"))) == 4:  # every outcome is in: a short grace to exit
                grace = grace if grace is not None else time.monotonic() + 15
                if time.monotonic() > grace:
                    break
            failed_early = [p for p in procs if p.poll() not in (None, 0)]
            if failed_early and not list(out.glob("rank*.json")):
                break  # e.g. the port was taken by another process before torchrun bound it
            time.sleep(0.2)
    finally:
        for p in procs:  # every worker of a launch is in its torchrun's session
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        tails = [p.communicate()[0].decode(errors="replace")[-3000:] for p in procs]
    hung = time.monotonic() > deadline
    done = len(list(out.glob("rank*.json"))) == 4
    if hung and not done:
        pytest.fail(f"torchrun {scenario} did not finish within {TIMEOUT_S}s (a hang):\n" + "\n".join(tails))
    return done, tails


def _torchrun(scenario: str, node_dirs, out: Path) -> list:
    """Launch node rank k in node_dirs[k]; returns the 4 ranks' outcomes."""
    out.mkdir(exist_ok=True)
    for attempt in range(3):
        for f in out.glob("rank*.json"):
            f.unlink()
        done, tails = _launch(scenario, node_dirs, out)
        if done or list(out.glob("rank*.json")):
            break
    assert done, f"torchrun {scenario}: not every rank wrote its outcome:\n" + "\n".join(tails)
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    for r, res in enumerate(results):
        assert res.get("ok"), f"rank {r}: {res.get('crash')}"
    return results


def _close(a, b, tol=1e-5):
    return all(abs(x - y) <= tol * abs(y) for x, y in zip(a, b))


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_nodes_each_with_its_own_gen_savedir(tmp_path):
    node_a, node_b = tmp_path / "A", tmp_path / "B"
    first = _torchrun("first", [node_a, node_b], tmp_path / "out")
    ref = first[0]["reference"]
    instance_dir = lambda node, inst: node / "gen" / "__main__.Net" / inst  # noqa: E731

    # every strategy trains like one process, bit-identically across strategies and ranks
    trained = ("code", "none_after_code", "all", "no_weights", "stale_setup")
    for res in first:
        for case in trained:
            assert "losses" in res[case], (case, res[case])
            assert res[case]["losses"] == first[0]["code"]["losses"], case
        assert _close(res["code"]["losses"], ref)
    # a receiving node holds what it was sent, and its manifest says so
    assert first[2]["all"]["files"] == first[0]["all"]["files"]
    assert "fullmodel.safetensors" not in first[2]["no_weights"]["files"]
    assert "graph.json" in first[2]["no_weights"]["files"]
    assert first[2]["code"]["files"] == ["constants.safetensors", "gencode0.py", "gencode1.py", "gencode2.py",
                                        "gencode3.py", "manifest.json"]
    manifest = json.loads((instance_dir(node_b, "c") / "manifest.json").read_text())
    assert sorted(manifest["files"]) == ["constants.safetensors", "gencode0.py", "gencode1.py", "gencode2.py",
                                         "gencode3.py"]
    assert manifest["received"]["strategy"] == "code"
    assert "fullmodel.safetensors" in manifest["received"]["omitted"]

    # none, code missing on node 1: every rank fails with the same clear error (not a collective's
    # timeout: that raises another error type; a hang is caught by TIMEOUT_S)
    missing = [res["none_missing"] for res in first]
    assert all(m.get("error") == "GenerationError" for m in missing), missing
    assert len({m["message"] for m in missing}) == 1
    assert "node 1 (ranks 2-3" in missing[0]["message"] and "broadcast_strategy='all'" in missing[0]["message"]
    assert str(instance_dir(node_b, "m")) in missing[0]["message"]

    # none, stale code of an earlier model (relu -> tanh) on node 1: refused, node and field named
    stale = [res["stale"] for res in first]
    assert all(s.get("error") == "PlanMismatchError" for s in stale), stale
    assert "node 1 (ranks 2-3" in stale[0]["message"] and "graph_fingerprint" in stale[0]["message"]
    assert str(instance_dir(node_b, "s")) in stale[0]["message"]

    # relaunch with the node ranks swapped: node B's received copy is rank 0's now
    swapped = _torchrun("swapped", [node_b, node_a], tmp_path / "out")
    for res in swapped:
        for case in ("code", "none"):
            assert res[case].get("losses") == first[0]["code"]["losses"], (case, res[case])
        # `all` cannot send the weights it never received: said, on every rank
        assert res["all"].get("error") == "GenerationError"
        assert "fullmodel.safetensors" in res["all"]["message"]
        assert "received with broadcast_strategy='code'" in res["all"]["message"]
    assert sorted(os.listdir(instance_dir(node_a, "c"))) == first[2]["code"]["files"]
