"""Resharding on load, through the public API on real gloo processes: train `SAVE_AT` steps
under plan A, save (sharded, deduped; rank 0 merges the sharded one), load into plan B with other
initial weights and train on: every loss and every parameter equal an uninterrupted single-process
run within 1e-5 (per tensor: norm of the difference over max(1, norm of the reference)), for A -> B
in {tp2 x dp2 + ZeRO -> dp4, tp4, tp2 x dp2 + ZeRO (resume), one process; pp2 x dp2 -> tp2 x dp2;
dp2 -> pp2}, from the sharded, the deduped and the merged checkpoint. The merged checkpoint holds
exactly the saved parameters and loads with plain safetensors. Each saving run also calls
prepare_async_save before its first step and async-saves beside its `save`: that first async_save
makes no buffer and starts no process, and writes `save`'s bytes. One launch per world size."""
from __future__ import annotations

import pytest
import torch

from launch import run_workers
from parity import assemble_full
from parity_workers import run_parity
from safetensors.torch import load_file, load_model

from training import SAVE_AT, STEPS, build, make_model, reference, rel_diff, train

TOL = 1e-5
KINDS = ("sharded", "deduped", "merged")


@pytest.fixture(scope="module")
def ref():
    return reference()


def _check(ref, label, per_rank, case):
    ref_losses, _, (ref_state, _) = ref
    for kind in KINDS:
        got = per_rank[0][case][kind]
        assert got["extra"]["step"] == SAVE_AT, f"{label} {kind}: extra {got['extra']}"
        for step, (a, b) in enumerate(zip(got["losses"], ref_losses[SAVE_AT:]), SAVE_AT):
            assert abs(a - b) <= TOL * max(1.0, abs(b)), f"{label} {kind} step {step}: loss {a} vs {b}"
        params = assemble_full(((r, res[case][kind]["shards"]) for r, res in enumerate(per_rank)), label)
        assert params, label
        for name, value in params.items():
            assert not torch.isnan(value).any(), f"{label} {kind}: parts of {name} held by no rank"
            assert rel_diff(value, ref_state[name]) <= TOL, f"{label} {kind}: {name} differs"


def _check_prepared_async(results, labels):
    for label in labels:
        for rank, per_rank in enumerate(results):
            same_writer, same_file = per_rank[label]["prepared_async"]
            assert same_writer, f"{label} rank {rank}: the first async_save after prepare_async_save made a buffer " \
                                f"or started a process"
            assert same_file, f"{label} rank {rank}: the async_save's rank file differs from save's"


def _check_merged(merged, ref, saved):
    """The merged checkpoint holds exactly the saving run's parameters, equals the single-process
    model's state_dict() and Adam state after the same steps, and loads with plain safetensors
    into the single-device model."""
    ref_state, ref_adam = ref[1]
    model = make_model(seed=3)
    missing, unexpected = load_model(model, merged / "model.safetensors")
    assert not missing and not unexpected
    for name, value in model.state_dict().items():
        assert name not in saved or torch.equal(value, saved[name]), f"merged: {name} is not what was saved"
        assert rel_diff(value, ref_state[name]) <= TOL, f"merged: {name}"
    weights = load_file(merged / "model.safetensors")
    assert set(weights) < set(ref_state) and len(weights) == len(ref_state) - 1  # the tied weight once
    optim = load_file(merged / "optimizer.safetensors")
    tied = {"wte.weight": "lm_head.weight", "lm_head.weight": "wte.weight"}
    for name, state in ref_adam.items():
        stored = name if f"{name}.exp_avg" in optim else tied[name]
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert rel_diff(optim[f"{stored}.{key}"], state[key]) <= TOL, f"merged Adam {key} of {name}"


@pytest.mark.multiprocess
def test_reshard_world4(tmp_path, ref):
    sources = [("tp-zero", 2), ("pp", 2)]
    targets = [("tp-zero2", "dp", 1), ("tp-zero2", "tp", 4), ("pp2", "tp", 2), ("tp-zero2", "tp-zero", 2)]
    results = run_workers(run_parity, 4, str(tmp_path), sources, targets, timeout=400)
    for label in ("tp-zero2", "pp2"):  # the saving runs themselves
        assert all(abs(a - b) <= TOL * max(1.0, abs(b)) for a, b in zip(results[0][label]["losses"], ref[0])), label
    _check_prepared_async(results, ("tp-zero2", "pp2"))
    for case in targets:
        _check(ref, f"{case[0]} -> {case[1]}{case[2]} x dp{4 // case[2]}", results, case)
    # resuming a deduped checkpoint on the plan that wrote it: each rank reads its own file only,
    # the pieces other ranks stored arrive from them
    for rank, per_rank in enumerate(results):
        assert per_rank[targets[-1]]["deduped"]["opened"] == [f"rank-{rank:05d}-of-00004.safetensors"], rank
    assert len(results[0][("tp-zero2", "dp", 1)]["sharded"]["opened"]) == 4  # another plan: reads what it needs
    saved = assemble_full(((r, res["tp-zero2"]["shards"]) for r, res in enumerate(results)), "saved")
    _check_merged(tmp_path / "ckpt" / "tp-zero2-merged", ref, saved)
    # one process: the tp2 x dp2 + ZeRO checkpoints into a plain module of a single process
    import nnscaler.ckpt as ckpt
    for kind in KINDS:
        pm, opt = build("one", 1, 1, str(tmp_path / "gen1"), seed=1)
        extra = ckpt.load(tmp_path / "ckpt" / f"tp-zero2-{kind}", pm, opt)
        assert extra["losses"] == results[0]["tp-zero2"]["losses"], kind
        losses = train(pm, opt, SAVE_AT, STEPS)
        for step, (a, b) in enumerate(zip(losses, ref[0][SAVE_AT:]), SAVE_AT):
            assert abs(a - b) <= TOL * max(1.0, abs(b)), f"one process {kind} step {step}: {a} vs {b}"
        for name, value in pm.state_dict().items():
            full = pm.fullmap[name].full_name
            assert rel_diff(value, ref[2][0][full]) <= TOL, f"one process {kind}: {full}"


@pytest.mark.multiprocess
def test_reshard_world2_fully_sharded(tmp_path, ref):
    """use_zero=3 checkpoints load into ZeRO-1, tp and use_zero=3 plans, ZeRO-1's into use_zero=3
    (sharded, deduped and merged), and merge to the single-device names and values; use_zero=3
    saves and loads its shards as held (no gather, rank files of the shards' size) and merges to the
    same bytes as a save of the whole local tensors."""
    sources = [("dp-zero3", 1), ("dp-zero", 1)]
    targets = [("dp-zero31", "dp-zero", 1), ("dp-zero31", "tp", 2), ("dp-zero31", "dp-zero3", 1),
               ("dp-zero1", "dp-zero3", 1), ("dp-zero1", "tp-zero3", 2)]
    results = run_workers(run_parity, 2, str(tmp_path), sources, targets, timeout=400)
    for label in ("dp-zero31", "dp-zero1"):
        assert all(abs(a - b) <= TOL * max(1.0, abs(b)) for a, b in zip(results[0][label]["losses"], ref[0])), label
    _check_prepared_async(results, ("dp-zero31", "dp-zero1"))
    for case in targets:
        _check(ref, f"{case[0]} -> {case[1]}{case[2]}", results, case)
    saved = assemble_full(((r, res["dp-zero31"]["shards"]) for r, res in enumerate(results)), "saved")
    _check_merged(tmp_path / "ckpt" / "dp-zero31-merged", ref, saved)
    # the shards are written and read where they are held: no all-gather in prepare_async_save, save
    # (sharded, deduped), async_save nor load (from any plan's checkpoint); a rank's file holds its
    # shards only (no tensor larger than a unit's shard); the merge equals that of the whole local
    # tensors saved inside unsharded() (the former path) byte for byte
    for rank, per_rank in enumerate(results):
        assert per_rank["dp-zero31"]["save_gathers"] == 0, f"rank {rank}: the use_zero=3 save gathered parameters"
        for case in targets:
            if case[1] == "dp-zero3" or case[1] == "tp-zero3":
                for kind in KINDS:
                    assert per_rank[case][kind]["load_gathers"] == 0, f"rank {rank}: {case} {kind} load gathered"
        held = per_rank["dp-zero31"]["held"]
        assert held["stored"] == held["held"] < held["local"], f"rank {rank}: {held}"
        assert held["largest"] <= held["largest_shard"], f"rank {rank}: {held}"
    assert results[0]["dp-zero31"]["held"]["merged_same"], "merging the use_zero=3 save differs from the former path"


@pytest.mark.multiprocess
def test_reshard_world2_dp_to_pp(tmp_path, ref):
    results = run_workers(run_parity, 2, str(tmp_path), [("dp", 1)], [("dp1", "pp", 2)], timeout=400)
    _check_prepared_async(results, ("dp1",))
    _check(ref, "dp2 -> pp2", results, ("dp1", "pp", 2))
