"""``use_zero=3`` units resharded to a smaller group after forward (FSDP2's ``reshard_after_forward``
as an int: ``pas_config["zero3_reshard_after_forward"] = 2``; `nnscaler.runtime.zero3_reshard`).

One launch of 4 gloo ranks (dp 4, one zero group of 4) trains, from the same weights as one process,
3 Adam steps in float64 of a tiny Hugging Face Llama with every unit resharded to groups of 2
ranks, without and with the decoder layers recomputed, and with a per-unit mapping (the layers to 2,
the head kept gathered, the rest the default): losses and every parameter match one process
(1e-10 relative); after forward each rank holds exactly half of every resharded unit (its padded
flat size / 2) and nothing else; backward's all-gathers of those units run over the 2 ranks of the
smaller group, each handing in its half (the comm stats' payload); nothing is held after backward.
The unit tier checks the parts' bookkeeping and the refusals of bad values.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

from launch import run_workers
from parity import one_process_adam

_MODELS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models")
if _MODELS not in sys.path:  # tests/models' Hugging Face builders (here and in the workers)
    sys.path.insert(0, _MODELS)

WORLD = 4
STEPS = 3
GLOBAL_BATCH = 8
LR = 1e-2
TOL = 1e-10
LAYERS = "model.model.layers.*"
CASES = {
    "k2": {"zero3_reshard_after_forward": 2},
    "k2-recompute": {"zero3_reshard_after_forward": 2, "recompute_modules": "LlamaDecoderLayer"},
    "map": {"zero3_reshard_after_forward": {LAYERS: 2, "model.lm_head": False}},
}


def _batch(step: int, n: int = GLOBAL_BATCH):
    import hf_models
    return hf_models.batch("llama", step, n)


def reference():
    """One process: (losses, parameters after STEPS steps)."""
    import hf_models
    return one_process_adam(hf_models.make("llama64"), _batch, steps=STEPS, lr=LR)


def _case(rank, gen_dir, label, pas):
    import hf_models
    from nnscaler import ComputeConfig, build_optimizer, parallelize
    from nnscaler.runtime.comm.stats import count_collectives
    per = GLOBAL_BATCH // WORLD
    cfg = ComputeConfig(1, WORLD, trace_strategy="cpu", use_zero=3, pas_config=pas)
    pm = parallelize(hf_models.make("llama64"), _batch(0, per), "dp", cfg, gen_savedir=gen_dir,
                     instance_name=f"reshard_{label.replace('-', '_')}")
    opt = build_optimizer(pm, torch.optim.Adam, lr=LR)
    fs = pm.fully_sharded
    smaller = fs.smaller
    resharded = [u for u in fs.units if u.name in smaller.group_of]
    out = {"losses": [], "held": [], "gathered_after_forward": [], "left": [], "backward": [],
           "resharded": sorted({u.name for u in resharded}), "kept": sorted(fs._keep),
           "expected_held": sum(u.padded // 2 for u in resharded),
           "groups": sorted({g.ranks for g in smaller.group_of.values()}),
           "code": open(sys.modules[type(pm).__module__].__file__).read()}
    for step in range(STEPS):
        opt.zero_grad()
        loss = pm(**{k: v[rank * per:(rank + 1) * per] for k, v in _batch(step).items()})
        out["held"].append(smaller.stats.held_numel)
        out["gathered_after_forward"].append(sorted(u.name for u in fs.units if u.full is not None))
        before = (smaller.stats.gathers, fs.stats.backward_gathers)
        with count_collectives() as comm:
            loss.backward()
        calls, nbytes = comm.calls("zero3_all_gather"), comm.bytes("zero3_all_gather")
        out["backward"].append(dict(calls=calls, bytes=nbytes, from_parts=smaller.stats.gathers - before[0],
                                    backward_gathers=fs.stats.backward_gathers - before[1]))
        out["left"].append((smaller.stats.held_numel, len(smaller.parts),
                            [u.name for u in fs.units if u.full is not None]))
        opt.step()
        t = loss.detach().reshape(1).clone()
        torch.distributed.all_reduce(t)
        out["losses"].append(t.item() / WORLD)
    out["part_bytes"] = {u.name: u.padded // 2 * 8 for u in resharded}
    out["stats"] = dict(kept=smaller.stats.kept, group_sizes=sorted(smaller.stats.group_sizes),
                        max_held=smaller.stats.max_held_numel)
    with pm.unsharded():
        out["params"] = {pm.fullmap[local].full_name: p.detach().clone() for local, p in pm.named_parameters()}
    return out


def _job(rank, world, gen_dir):
    return {label: _case(rank, gen_dir, label, pas) for label, pas in CASES.items()}


@pytest.mark.multiprocess
def test_reshard_to_a_smaller_group_after_forward(tmp_path):
    ref_losses, ref_params = reference()
    results = run_workers(_job, WORLD, str(tmp_path / "gen"), timeout=600)
    for rank, per_rank in enumerate(results):
        for label in CASES:
            got, where = per_rank[label], f"{label} rank {rank}"
            for s, (a, b) in enumerate(zip(got["losses"], ref_losses)):
                assert abs(a - b) <= TOL * abs(b), f"{where} step {s}: loss {a} vs {b}"
            assert set(got["params"]) == set(ref_params), where
            for name, value in got["params"].items():
                ref = ref_params[name]
                assert ((value - ref).norm() / ref.norm()).item() <= TOL, f"{where}: {name}"
            # the smaller groups: ranks 0-1 and 2-3 (consecutive ranks of the zero group)
            assert got["groups"] == [(0, 1)] if rank < 2 else [(2, 3)], (where, got["groups"])
            assert got["stats"]["group_sizes"] == [2], (where, got["stats"])
            # after forward: half of every resharded unit, nothing else (but the units kept gathered)
            assert got["held"] == [got["expected_held"]] * STEPS and got["expected_held"] > 0, (where, got["held"])
            assert all(g == got["kept"] for g in got["gathered_after_forward"]), where
            # backward gathers the resharded units from the halves over 2 ranks: every all-gather
            # there is from a part, each handing in half a unit
            for b in got["backward"]:
                if label == "map":  # the layers from the halves, the root (the default) over the whole zero group
                    assert b["from_parts"] == 2 and b["calls"] == 3, (where, b)
                    continue
                assert b["calls"] == b["from_parts"] >= b["backward_gathers"] > 0, (where, b)  # (less: prefetched)
                assert b["bytes"] in _sums(got["part_bytes"].values(), b["calls"]), (where, b, got["part_bytes"])
            assert all(left == (0, 0, []) for left in got["left"]), (where, got["left"])  # nothing after backward
        k2, rec, mapped = per_rank["k2"], per_rank["k2-recompute"], per_rank["map"]
        assert "" in k2["resharded"] and len(k2["resharded"]) == len(set(k2["resharded"])) and k2["kept"] == []
        assert rec["code"].count("torch.utils.checkpoint.checkpoint(") == 2 and rec["resharded"] == k2["resharded"]
        assert mapped["kept"] == ["model.lm_head"] and all(u.startswith("model.model.layers.")
                                                          for u in mapped["resharded"]), mapped["resharded"]
        # without recomputation backward gathers each block and the head, the root (final norm) once
        assert [b["calls"] for b in k2["backward"]] == [len(k2["resharded"]) - 1] * STEPS, k2["backward"]


def _sums(values, n):
    """Every sum of `n` of `values` (with repeats)."""
    import itertools
    return {sum(c) for c in itertools.combinations_with_replacement(list(values), n)}


# -- unit tier: no processes -----------------------------------------------------------------------

def test_parts_are_kept_once_and_dropped():
    from nnscaler.runtime.zero3 import ShardUnit
    from nnscaler.runtime.zero3_reshard import SmallerGroup, SmallerReshard
    params = [torch.nn.Parameter(torch.arange(6.0).view(2, 3)), torch.nn.Parameter(torch.arange(3.0))]
    unit = ShardUnit("h.0", ["a", "b"], params, group_size=4)  # 9 elements padded to 12
    r = SmallerReshard({"h.0": 2}, {2: SmallerGroup(2, 1, (2, 3))})
    full = torch.arange(12.0)
    r.keep(unit, full)
    r.keep(unit, full * 0)  # kept once per forward: the first part stays
    assert r.holds(unit) and torch.equal(r.parts[id(unit)], torch.arange(6.0, 12.0))
    assert r.parts[id(unit)].untyped_storage().data_ptr() != full.untyped_storage().data_ptr()  # a copy
    assert r.stats.held_numel == r.stats.max_held_numel == 6 and r.stats.kept == 1
    r.drop(unit)
    r.drop(unit)
    assert not r.holds(unit) and r.stats.held_numel == 0
    other = ShardUnit("", ["c"], [torch.nn.Parameter(torch.ones(4))], group_size=4)
    r.keep(other, torch.ones(4))  # not resharded to a smaller group: nothing kept
    assert not r.holds(other) and bool(r) and not SmallerReshard({}, {})


def test_smaller_groups_cut_each_zero_group_into_consecutive_ranks():
    from nnscaler.runtime.zero3_reshard import smaller_rank_sets
    assert smaller_rank_sets(1, 4, 1, 2) == [(0, 1), (2, 3)]  # dp 4: the test above
    # tp 2 x dp 8, two zero groups of 4 per plan device: pairs inside each zero group
    assert smaller_rank_sets(2, 16, 2, 2) == [(0, 2), (4, 6), (8, 10), (12, 14), (1, 3), (5, 7), (9, 11), (13, 15)]
    assert smaller_rank_sets(1, 8, 1, 4) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    for plan, world, ngroups, k in ((1, 4, 1, 2), (2, 16, 2, 2), (2, 16, 1, 4), (4, 32, 2, 2)):
        sets = smaller_rank_sets(plan, world, ngroups, k)
        assert sorted(r for s in sets for r in s) == list(range(world)) and {len(s) for s in sets} == {k}
        z = world // plan // ngroups
        for s in sets:  # each inside one zero group: the same plan device, the same zero group
            assert len({r % plan for r in s}) == 1 and len({(r // plan) // z for r in s}) == 1, s


def test_bad_values_are_refused_naming_the_key():
    from nnscaler import ComputeConfig
    from nnscaler.ir import ConfigError
    key = r"pas_config\['zero3_reshard_after_forward'\]"
    for bad, text in ((3, "does not divide the zero group size 4"), (0, "at least 1"), (-2, "at least 1"),
                      ("2", "not a string"), ("False", "not a string"), (2.0, "or an int dividing"),
                      ({"model.layers.*": 8}, r"\['model.layers.\*'\] is 8, which does not divide")):
        with pytest.raises(ConfigError, match=key + ".*" + text):
            ComputeConfig(1, 8, use_zero=3, zero_ngroups=2, pas_config={"zero3_reshard_after_forward": bad})
    for good in (1, 2, 4, True, False, {"model.layers.*": 2, "": False}):
        ComputeConfig(1, 8, use_zero=3, zero_ngroups=2, pas_config={"zero3_reshard_after_forward": good})
