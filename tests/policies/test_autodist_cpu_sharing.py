"""How much slower a rank runs beside the job's other local processes on a CPU
(nnscaler.policies.autodist.cpu_sharing): measured with forked peers running the traced graph,
cached; the plain division of the cores when asked not to measure."""
from __future__ import annotations

import math
import os
import sys

import pytest
import torch

import gpt
from nnscaler.ir import trace
from nnscaler.policies.autodist.cpu_sharing import ENV, cpu_scale, shared_cores
from nnscaler.policies.autodist.op_profile import ProfileDB


def _graph():
    cfg = gpt.GPTConfig(n_layer=2, n_embd=64, n_head=4, block_size=32, vocab_size=128)
    torch.manual_seed(0)
    return trace(gpt.GPT(cfg), gpt.random_batch(0, 2, cfg))


def test_plain_division_when_asked_not_to_measure(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, "plain")
    db = ProfileDB(tmp_path / "p.json")
    scale, note = cpu_scale(_graph(), db, "cpu", procs=4 * shared_cores(), threads=1)
    assert scale == pytest.approx(4.0) and ENV in note
    assert not db.entries  # nothing measured, nothing stored
    assert cpu_scale(_graph(), db, "cpu", procs=1, threads=1) == (1.0, None)
    assert cpu_scale(_graph(), db, "cuda", procs=8, threads=1) == (1.0, None)


@pytest.mark.multiprocess  # forks peers
def test_measured_with_peers_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, "measure")
    graph, db = _graph(), ProfileDB(tmp_path / "p.json")
    procs = 2 * shared_cores()  # twice as many one-thread processes as cores
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        scale, note = cpu_scale(graph, db, "cpu", procs=procs, threads=1)
    finally:
        torch.set_num_threads(threads)
    (key,) = [k for k in db.entries if k.startswith("__cpu_sharing__")]
    entry = db.entries[key]
    _check_measured(scale, note, entry, procs)
    # cached: the stored times are used, nothing measured again
    db.entries[key] = {"alone": 1.0, "busy": 2.5}
    assert cpu_scale(graph, db, "cpu", procs=procs, threads=1) == (pytest.approx(2.5), None)
    # never below the division of the cores (a block too short to see the sharing)
    db.entries[key] = {"alone": 1.0, "busy": 1.2}
    assert cpu_scale(graph, db, "cpu", procs=procs, threads=1) == (pytest.approx(2.0), None)
    # a ratio far over the division (a disturbed measurement): the division, and why
    db.entries[key] = {"alone": 1.0, "busy": 5.0}
    scale, note = cpu_scale(graph, db, "cpu", procs=procs, threads=1)
    assert scale == pytest.approx(2.0) and "5.00x slower beside its peers" in note


def _check_measured(scale, note, entry, procs):
    """What a measurement gives, whatever the machine's load (the figures are bench/autodist.py's
    `compute_scale`): both times stored, and the scale derived from them as documented."""
    plain = procs / shared_cores()
    assert math.isfinite(entry["alone"]) and entry["alone"] > 0
    assert math.isfinite(entry["busy"]) and entry["busy"] > 0
    factor = entry["busy"] / entry["alone"]
    if note is None:  # never below the division of the cores
        assert scale == pytest.approx(max(plain, factor))
    else:  # a ratio over twice the division is a disturbed measurement: the division, said why
        assert scale == pytest.approx(plain) and f"{factor:.2f}x slower beside its peers" in note


def _measure_in_a_job(rank, world, cache):
    """Rank 0 of a running gloo job measures (as it searches the plan while the others wait): the
    forked peers must not touch its group."""
    import torch.distributed as dist
    os.environ[ENV] = "measure"
    scale, note, entry = None, None, None
    if rank == 0:
        db = ProfileDB(os.path.join(cache, "p.json"))
        scale, note = cpu_scale(_graph(), db, "cpu", procs=2 * shared_cores(), threads=1)
        (entry,) = [v for k, v in db.entries.items() if k.startswith("__cpu_sharing__")]
    t = torch.ones(1)
    dist.all_reduce(t)  # the group still works after the peers came and went
    return scale, note, entry, float(t)


@pytest.mark.multiprocess
def test_measured_inside_a_running_gloo_job(tmp_path):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "runtime"))
    from launch import run_workers
    (scale, note, entry, reduced), (*_, other) = run_workers(_measure_in_a_job, 2, str(tmp_path), timeout=120)
    _check_measured(scale, note, entry, 2 * shared_cores())  # measured (no error), not the plain division
    assert reduced == other == 2.0
