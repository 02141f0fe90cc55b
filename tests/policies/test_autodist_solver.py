"""autodist's search on the GPT example: complete plans with finite estimates, the memory limit
obeyed (or a clear NoPlanFits), the MILP no worse than the all-replicated and the greedy plans,
repeated layers tied, search time by depth, partition constraints (YAML) obeyed and bad rules
refused, recompute_modules honoured (nnscaler.policies.autodist)."""
from __future__ import annotations

import math
import re
import time
from collections import defaultdict

import pytest
import torch

import gpt
from nnscaler.ir import ComputeConfig, ConfigError, trace
from nnscaler.policies import apply_policy, validate_plan
from nnscaler.policies.autodist import AutodistConfig, NoPlanFits, search
from nnscaler.policies.autodist import spmd_solver
from nnscaler.policies.autodist.comm_model import CommModel
from nnscaler.policies.autodist.constraints import load_constraints
from nnscaler.policies.autodist.layers import tie_layers
from nnscaler.policies.autodist.op_keys import op_keys
from nnscaler.policies.autodist.policy import _Search, _transient
from nnscaler.policies.autodist.spmd_solver import size_text, solve
from nnscaler.policies.recompute import recompute_modules

COMM = {"backend": "given", "collectives": {c: {"2": [1e-5, 5e9], "4": [2e-5, 5e9]}
                                            for c in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")}}
LAYER = re.compile(r"^h\.(\d+)(\..*|)\|")


def gpt_graph(n_layer=2, **kw):
    cfg = gpt.GPTConfig(n_layer=n_layer, **kw)
    torch.manual_seed(0)
    return trace(gpt.GPT(cfg), gpt.random_batch(0, 4, cfg))


def compute(plan_ngpus=2, runtime_ngpus=None, **pas):
    return ComputeConfig(plan_ngpus, runtime_ngpus or plan_ngpus,
                         pas_config={"_comm_profile": COMM, "_profile_repeats": 1, **pas})


def autodist(graph, plan_ngpus=2, **pas):
    return apply_policy(graph, compute(plan_ngpus, **pas), "autodist")


def problem_of(graph, plan_ngpus=2, **pas):
    """The cost model the policy builds for `graph` (same profile cache, same config)."""
    cfg = AutodistConfig.from_compute_config(compute(plan_ngpus, **pas))
    return _Search(graph, cfg).problem(plan_ngpus, CommModel(COMM)), cfg


def least_memory(problem) -> float:
    return problem.const_mem + sum(min(op.mem) for op in problem.ops)


def choices_by_key(graph):
    return {o.key: o.choice for o in graph.autodist_plan.ops}


def per_layer(choices):
    """{path inside the layer|op|k: {layer index: choice}} for the ops of h.<i>."""
    out = defaultdict(dict)
    for key, choice in choices.items():
        m = LAYER.match(key)
        if m:
            out[m.group(2) + key[m.end() - 1:]][int(m.group(1))] = choice
    return out


# -- the plan ---------------------------------------------------------------------------------------
def test_plan_is_complete_with_finite_estimate():
    graph = autodist(gpt_graph())
    validate_plan(graph, 2, "autodist")
    assert all(node.pieces for node in graph.nodes)
    assert {p.device for node in graph.nodes for p in node.pieces} == {0, 1}
    record = graph.autodist_plan
    est = record.estimate
    assert math.isfinite(est["time_s"]) and est["time_s"] > 0
    assert math.isfinite(est["mem_bytes"]) and est["mem_bytes"] > 0
    assert record.method.startswith("milp") and record.plan_ngpus == 2 and record.module_class == "gpt.GPT"
    keys = op_keys(graph)
    assert [o.key for o in record.ops] == [keys[n.id] for n in graph.nodes]
    for node in graph.nodes:  # the pieces are what the record says
        choice = next(o.choice for o in record.ops if o.key == keys[node.id])
        dims = {p.dim for p in node.pieces}
        assert dims == ({None} if choice == "R" else {choice}), node.describe()


def test_memory_limit_between_least_and_replicated_is_obeyed():
    problem, cfg = problem_of(gpt_graph())
    replicated = [0] * len(problem.ops)
    least = least_memory(problem)
    whole = problem.evaluate(replicated)[1]
    assert least < whole
    limit = (least + whole) / 2 + _transient(problem, replicated, cfg.transient_mem_coef)
    assert whole + _transient(problem, replicated, cfg.transient_mem_coef) > limit  # replication does not fit
    graph = gpt_graph()
    autodist(graph, mem_constraint=limit / 1024 ** 3)
    est = graph.autodist_plan.estimate
    assert est["mem_bytes"] <= limit * (1 + 1e-9)
    assert est["mem_limit_bytes"] == pytest.approx(limit)
    # some parameter is sharded: an op that reads a parameter took a choice storing less of it
    chosen = choices_by_key(graph)
    keys = op_keys(graph)
    sharded = []
    for op in problem.ops:
        label = chosen[keys[op.node.id]]
        c = op.labels.index(label)
        if op.param_mem[c] < max(op.param_mem):
            sharded.append(keys[op.node.id])
    assert sharded, "no parameter is sharded under a limit replication exceeds"
    # and the unlimited plan is not slower (the limit costs time, if anything)
    free = autodist(gpt_graph())
    assert free.autodist_plan.estimate["time_s"] <= est["time_s"] * (1 + 1e-3)  # HiGHS's relative gap: 1e-4


def test_impossible_limit_raises_no_plan_fits_with_the_smallest_memory():
    problem, _ = problem_of(gpt_graph())
    with pytest.raises(NoPlanFits) as err:
        autodist(gpt_graph(), mem_constraint=1e-6)
    message = str(err.value)
    assert "no plan fits mem_constraint" in message
    assert f"smallest plan found needs {size_text(least_memory(problem))}" in message
    assert isinstance(err.value, ConfigError)


@pytest.mark.parametrize("limited", [False, True])
def test_milp_no_worse_than_replicated_and_greedy(limited, monkeypatch):
    problem, cfg = problem_of(gpt_graph())
    tie = tie_layers(problem)
    replicated = [0] * len(problem.ops)
    limit = None
    if limited:
        limit = (least_memory(problem) + problem.evaluate(replicated)[1]) / 2
    milp = solve(problem, limit, tie)
    assert milp.method == "milp"
    with monkeypatch.context() as m:
        m.setattr(spmd_solver, "_milp", lambda *a, **k: (None, None))  # the fallback
        greedy = solve(problem, limit, tie)
    assert greedy.method == "greedy"
    for sol in (milp, greedy):
        t, mem = problem.evaluate(sol.pick)
        assert (t, mem) == pytest.approx((sol.time, sol.mem))
        if limit is not None:
            assert mem <= limit * (1 + 1e-9)
    # HiGHS stops within its relative gap (1e-4): allow that much
    assert milp.time <= greedy.time * (1 + 1e-3)
    if limit is None:
        assert milp.time <= problem.evaluate(replicated)[0] * (1 + 1e-3)
    else:
        assert problem.evaluate(replicated)[1] > limit  # replication is not a candidate there


def test_repeated_layers_are_tied():
    graph = autodist(gpt_graph(4))
    layers = per_layer(choices_by_key(graph))
    assert layers and all(sorted(by_layer) == [0, 1, 2, 3] for by_layer in layers.values())
    different = {op: by_layer for op, by_layer in layers.items() if len(set(by_layer.values())) > 1}
    assert not different, different
    problem, _ = problem_of(gpt_graph(4))
    tie = tie_layers(problem)
    for i, op in enumerate(problem.ops):
        path = op.node.module_path
        if path.startswith(("h.1.", "h.2.", "h.3.")) or path in ("h.1", "h.2", "h.3"):
            rep = problem.ops[tie[i]].node
            assert tie[i] != i and (rep.module_path == "h.0" or rep.module_path.startswith("h.0.")), path
            assert rep.target == op.node.target


def test_search_time_by_depth(capsys):
    times = {}
    for n_layer in (4, 8, 16, 32):
        graph = gpt_graph(n_layer)
        cfg = AutodistConfig.from_compute_config(compute(2))
        start = time.perf_counter()
        record, labels, cut = search(graph, cfg)
        times[n_layer] = time.perf_counter() - start
        assert cut is None and len(record.ops) == len(graph.nodes)
        assert math.isfinite(record.estimate["time_s"])
        layers = per_layer({o.key: o.choice for o in record.ops})
        assert all(len(by_layer) == n_layer and len(set(by_layer.values())) == 1 for by_layer in layers.values())
    with capsys.disabled():
        print("\nautodist search time by GPT depth (cached profile): "
              + ", ".join(f"{k} layers {v:.3f} s" for k, v in times.items()))


# -- partition constraints --------------------------------------------------------------------------
def test_constraints_are_obeyed(tmp_path):
    rules = tmp_path / "rules.yaml"
    rules.write_text('- module: "h.*.attn"\n  op: linear\n  allowed: [R]\n'
                     '- module: MLP\n  op: linear\n  allowed: [k]\n'
                     '- module: LayerNorm\n  replicate: true\n')
    graph = autodist(gpt_graph(), partition_constraints_path=str(rules))
    choices = choices_by_key(graph)
    attn = {k: c for k, c in choices.items() if re.match(r"h\.\d+\.attn\.\w+\|linear\|", k)}
    mlp = {k: c for k, c in choices.items() if re.match(r"h\.\d+\.mlp\.\w+\|linear\|", k)}
    norms = {k: c for k, c in choices.items() if "|layer_norm|" in k}
    assert len(attn) == 8 and set(attn.values()) == {"R"}
    assert len(mlp) == 4 and set(mlp.values()) == {"k"}
    assert len(norms) == 5 and set(norms.values()) == {"R"}
    for node in graph.nodes:  # the pieces follow
        if re.match(r"h\.\d+\.mlp\.", node.module_path) and node.short_name == "linear":
            assert {p.dim for p in node.pieces} == {"k"}


BAD_RULES = [
    ('- module: "h.*.attn"\n  op: linear\n  allowd: [R]\n', "rule 1 has unknown key(s) ['allowd']"),
    ('- module: NoSuchModule\n  replicate: true\n', "rule 1 ({'module': 'NoSuchModule', 'replicate': True}) matches no op"),
    ('- module: Block\n  replicate: true\n- op: no_such_op\n  allowed: [R]\n', "rule 2"),
    ('- op: linear\n  allowed: [zz]\n', "rule 1 leaves op"),
    ('- module: MLP\n  op: linear\n  allowed: [n, R]\n- module: MLP\n  op: linear\n  allowed: [k]\n', "rule 2 leaves op"),
    ('- op: linear\n  allowed: []\n', "rule 1: allowed must be a non-empty list"),
    ('- op: linear\n  allowed: R\n', "rule 1: allowed must be a non-empty list"),
    ('- op: linear\n  allowed: [R, 1]\n', "rule 1: allowed must be a non-empty list"),
    ('- op: linear\n  replicate: false\n', "rule 1: replicate must be true"),
    ('- op: linear\n  replicate: true\n  allowed: [R]\n', "rule 1 needs exactly one of"),
    ('- op: linear\n', "rule 1 needs exactly one of"),
    ('- allowed: [R]\n', "rule 1 names neither a module nor an op"),
    ('- linear\n', "rule 1 must be a mapping"),
    ('module: Block\nreplicate: true\n', "must be a YAML list of rules"),
    ('- op: [unclosed\n', "is not valid YAML"),
]


@pytest.mark.parametrize("text,expected", BAD_RULES)
def test_bad_constraint_refused(text, expected, tmp_path):
    rules = tmp_path / "rules.yaml"
    rules.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_constraints(rules, gpt_graph(), 2)
    assert expected in str(err.value) and str(rules) in str(err.value), str(err.value)


def test_bad_constraint_refused_by_the_policy(tmp_path):
    rules = tmp_path / "rules.yaml"
    rules.write_text('- module: "h.*.attn"\n  replicate: true\n- module: "decoder.*"\n  replicate: true\n')
    with pytest.raises(ConfigError, match=r"rule 2 .*matches no op of gpt.GPT"):
        autodist(gpt_graph(), partition_constraints_path=str(rules))


# -- recompute ----------------------------------------------------------------------------------------
def _activation_bytes(plan_graph, recompute: bool) -> float:
    """The activation memory of `plan_graph`'s plan, priced on a fresh trace (Block recomputed or not)."""
    fresh = gpt_graph()
    if recompute:
        recompute_modules(fresh, "Block")
    problem, _ = problem_of(fresh)
    keys = op_keys(fresh)
    chosen = choices_by_key(plan_graph)
    return sum(op.act_mem[op.labels.index(chosen[keys[op.node.id]])] for op in problem.ops)


def test_recompute_modules_marks_ops_and_lowers_activation_memory():
    graph = autodist(gpt_graph(), recompute_modules="Block")
    for node in graph.nodes:
        inside = node.module_path.startswith("h.")
        assert (node.recompute is not None) == inside, node.describe()
    assert {n.recompute for n in graph.nodes if n.recompute} == {"h.0", "h.1"}
    plain = autodist(gpt_graph())
    assert not any(n.recompute for n in plain.nodes)

    with_recompute, without = _activation_bytes(graph, True), _activation_bytes(plain, False)
    assert 0 < with_recompute < without
    # the same plan priced both ways: less memory, more time (forward run twice) with recompute
    fresh = gpt_graph()
    cfg = AutodistConfig.from_compute_config(compute(2))
    s = _Search(fresh, cfg)
    before = s.problem(2, CommModel(COMM))
    recompute_modules(fresh, "Block")
    s.problems.clear()
    after = s.problem(2, CommModel(COMM))
    pick = [0] * len(before.ops)
    (t0, m0), (t1, m1) = before.evaluate(pick), after.evaluate(pick)
    assert m1 < m0 and t1 > t0


def _pipeline_case(limit, pivots="Block"):
    import gpt
    from nnscaler.ir import ComputeConfig, trace
    from nnscaler.policies import apply_policy
    cfg = gpt.GPTConfig(n_layer=4, n_embd=64, n_head=2, block_size=8, vocab_size=64)
    comm = {"backend": "given", "collectives": {c: {"2": [1e-5, 5e9]} for c in
                                                ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")}}
    pas = {"_comm_profile": comm, "update_freq": 4, "max_partition_degree": 1, "mem_constraint": limit}
    if pivots:
        pas["pipeline_pivots"] = pivots
    graph = trace(gpt.GPT(cfg), gpt.random_batch(0, 2, cfg))
    return apply_policy(graph, ComputeConfig(2, 2, use_end2end=True, pas_config=pas), "autodist")


def test_a_limit_only_a_pipeline_meets_gives_a_pipeline():
    """max_partition_degree=1: without a pipeline every op is replicated on both devices; a limit
    below that plan's memory is met only by cutting the model into 2 stages."""
    from nnscaler.policies.autodist import NoPlanFits
    with pytest.raises(NoPlanFits) as info:
        _pipeline_case(0.0001, pivots=None)
    replicated = info.value.smallest
    with pytest.raises(NoPlanFits) as info:
        _pipeline_case(0.0001)
    assert "as a 2-stage pipeline" in str(info.value) and info.value.smallest < replicated
    limit_gb = (info.value.smallest + replicated) / 2 / 1024 ** 3 + 0.002  # room for transient buffers
    graph = _pipeline_case(limit_gb)
    record = graph.autodist_plan
    assert record.pipeline == {"nstages": 2, "tp_size": 1, "nmicros": 4, "scheduler": "1f1b"}
    assert record.estimate["mem_bytes"] <= limit_gb * 1024 ** 3
    assert {n.stage for n in graph.nodes} == {0, 1} and graph.pipeline is not None
