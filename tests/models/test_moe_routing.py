"""Expert parallelism never hangs, whatever the router does: a model whose router is rigged by the
data (tests/models/rigged_moe.py) trains through every routing case (at random; every token to
rank 0's experts, to the last rank's, to one expert, to one expert only; the first and last ranks
only, so that the middle ranks' experts receive no row; one token away from the others; the two
halves crossed) one Adam step each, and equals one process in float64 (every loss and parameter
within 1e-9). Each launch has a deadline, so a hang fails the test.

- 2 processes: ``ep`` 2, and ``ep`` 2 with every block recomputed in backward;
- 4 processes: ``ep`` 4, ``ep`` 2 x dp 2 with recomputation, ``pp`` 2 x ``ep`` 2 (2 micro-batches)
  with recomputation, and ``ep`` 2 x dp 2 with ``use_zero=3``, without and with recomputation.

With a capacity factor (token dropping, ``ep`` 2, ``ep`` 4 with recomputation, ``ep`` 4 with
``ep_size`` 2 and recomputation (each rank storing 1/4 of the experts, the tokens exchanged inside
pairs), and ``tp`` 2, which keeps the op's tokens whole) the parallel plans drop the pairs one
process drops.

Every rank of a unit (of a pipeline stage) runs the same collectives, as many of each kind, in
every step; the expert-load record holds the step's load per layer (summed over its micro-batches:
the unit's tokens x top-k, none on an expert the rig forbids) and never grows: one entry per layer.
"""
from __future__ import annotations

import pytest
import torch

import rigged_moe as rm
from launch import run_workers
from parity import assemble_full

TOL = 1e-9
RECOMPUTE = {"recompute_modules": "RiggedBlock"}
CAPACITY = 1.0  # with it, the one-expert cases drop most pairs
PLANS2 = [("ep2", 2, {}), ("ep2-recompute", 2, {"pas_config": RECOMPUTE}),
          ("ep2-capacity", 2, {"capacity": CAPACITY}), ("tp-capacity", 2, {"policy": "tp", "capacity": CAPACITY})]
PLANS4 = [("ep4", 4, {}), ("ep2-dp2-recompute", 2, {"pas_config": RECOMPUTE}),
          ("pp2-ep2-recompute", 4, {"use_end2end": True,
                                    "pas_config": {"pp_size": 2, "pipeline_nmicros": rm.NMICROS, **RECOMPUTE}}),
          ("ep2-dp2-zero3", 2, {"use_zero": 3}), ("ep2-dp2-zero3-recompute", 2, {"use_zero": 3, "pas_config": RECOMPUTE}),
          ("ep4-capacity-recompute", 4, {"capacity": CAPACITY, "pas_config": RECOMPUTE}),
          ("ep4-ep2-capacity-recompute", 4, {"capacity": CAPACITY, "pas_config": {"ep_size": 2, **RECOMPUTE}})]


def _forbidden(step):
    """The experts no token of case `step` may reach (the rig masks them for every token, and each
    token has at least top-k experts allowed)."""
    how = rm.CASES[step][1]
    if not how.startswith("class ") or "one token" in how:
        return set()
    allowed, _ = rm.ROUTES[int(how.split()[1])]
    return set() if allowed is None or len(allowed) < rm.K else set(range(rm.EXPERTS)) - set(allowed)


def _check(results, plans, world):
    refs = {}
    for label, plan_ngpus, cfg in plans:
        halves = world > plan_ngpus or "pp_size" in cfg.get("pas_config", {})
        key = (halves, cfg.get("capacity"))
        if key not in refs:
            refs[key] = rm.reference(*key)
        want_losses, want_params = refs[key]
        losses = results[0][label][0]
        for step, (got, want) in enumerate(zip(losses, want_losses)):
            assert abs(got - want) <= TOL * max(1.0, abs(want)), f"{label} step {step} ({rm.CASES[step][0]}): {got} vs {want}"
        params = assemble_full(((r, res[label][1]) for r, res in enumerate(results)), label)
        assert set(params) == set(want_params), (label, set(params) ^ set(want_params))
        for name, value in params.items():
            diff = (value - want_params[name]).abs().max().item()
            assert diff <= TOL, f"{label}: {name} differs by {diff}"
        pipeline = "pp_size" in cfg.get("pas_config", {})
        groups = [[0, 1], [2, 3]] if pipeline else [list(range(world))]  # ranks that run the same collectives
        unit_tokens = rm.GLOBAL_BATCH // (world // plan_ngpus) * rm.SEQ
        if cfg.get("policy", "ep") != "ep":
            continue  # the experts are not split: no exchange, no load record
        for step, (case, _) in enumerate(rm.CASES):
            for ranks in groups:
                calls = [results[r][label][2][step] for r in ranks]
                assert all(c == calls[0] for c in calls), (label, case, calls)
                assert calls[0].get("all_to_all", 0) > 0, (label, case, calls[0])
            for rank in range(world):
                load = results[rank][label][3][step]
                assert len(load) == (1 if pipeline else rm.LAYERS), (label, case, rank, load)  # one entry per layer
                for layer, counts in load.items():
                    assert sum(counts) == unit_tokens * rm.K, (label, case, layer, counts)
                    assert all(counts[e] == 0 for e in _forbidden(step)), (label, case, layer, counts)
                    peer = rank - rank % (plan_ngpus // 2 if pipeline else plan_ngpus)  # first rank of its unit (stage)
                    assert results[peer][label][3][step][layer] == counts, (label, case, rank)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_rigged_routers_on_2_processes(tmp_path):
    results = run_workers(rm.train, 2, PLANS2, str(tmp_path / "gen"), timeout=120)
    _check(results, PLANS2, 2)
    dropless, dropping = rm.reference()[0], rm.reference(capacity=CAPACITY)[0]
    assert all(a != b for a, b in zip(dropless[1:], dropping[1:]))  # the capacity drops pairs (all to one expert: most)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_rigged_routers_on_4_processes(tmp_path):
    results = run_workers(rm.train, 4, PLANS4, str(tmp_path / "gen"), timeout=120)
    _check(results, PLANS4, 4)
    for rank in range(4):  # ep_size 2: each rank stores its 1/4 of the experts (2 of 8), as under ep 4
        held = [(tuple(full), tuple(slices[0])) for name, full, slices, _ in results[rank]["ep4-ep2-capacity-recompute"][1]
                if name.endswith(("gate_up", "down"))]
        assert len(held) == 2 * rm.LAYERS and all(s == (rank * rm.EXPERTS // 4, (rank + 1) * rm.EXPERTS // 4)
                                                  for _, s in held), (rank, held)
