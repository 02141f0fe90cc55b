"""Sharing generated code between nodes, and rank 0 failures, on real gloo processes.

Each rank plays a node of its own (LOCAL_WORLD_SIZE=1) with its own working directory, so a
relative gen_savedir is a different directory per "node", as on machines without shared storage.
"""
from __future__ import annotations

import os

import pytest
import torch

import toy_models
from launch import run_workers


def _as_own_node(rank, base):
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    os.environ["LOCAL_RANK"] = "0"
    node_dir = os.path.join(base, f"node{rank}")
    os.makedirs(node_dir, exist_ok=True)
    os.chdir(node_dir)


def share_code(rank, world, base):
    from nnscaler import ComputeConfig, parallelize

    _as_own_node(rank, base)
    cfg = ComputeConfig(1, world, trace_strategy="cpu")
    out = {}
    for strategy in ("none", "all", "no_weights", "code"):
        try:
            gen_cls = parallelize(toy_models.MLP, toy_models.mlp_batch(0, 2), "dp", cfg, gen_savedir="gen",
                                  instance_name=strategy, broadcast_strategy=strategy)
        except Exception as e:  # noqa: BLE001 - the outcome per strategy is what the test checks
            out[strategy] = ("error", type(e).__name__, str(e))
            continue
        try:
            pm = gen_cls()  # init_params=True needs the initial weights on this node
            out[strategy] = ("weights", pm.layers_0_weight.detach().clone())
        except Exception as e:  # noqa: BLE001
            pm = gen_cls(init_params=False)
            out[strategy] = ("no weights", type(e).__name__, str(e), sorted(os.listdir(
                os.path.dirname(type(pm).__module__ and __import__("sys").modules[type(pm).__module__].__file__))))
    os.chdir(base)
    return out


def rank0_failure(rank, world, base):
    from nnscaler import ComputeConfig, parallelize

    def failing_policy(graph, cfg):
        raise ValueError("this policy refuses the graph")

    outcomes = []
    for policy in (failing_policy, "dp"):  # after a failure the job goes on normally
        try:
            parallelize(toy_models.MLP(), toy_models.mlp_batch(0, 2), policy, ComputeConfig(1, world, trace_strategy="cpu"),
                        gen_savedir=os.path.join(base, "gen"))
            outcomes.append("ok")
        except Exception as e:  # noqa: BLE001
            outcomes.append(f"{type(e).__name__}: {e}")
    return outcomes


@pytest.mark.multiprocess
def test_broadcast_strategies_between_nodes(tmp_path):
    results = run_workers(share_code, 2, str(tmp_path), timeout=180)
    rank0, rank1 = results
    assert all(v[0] == "weights" for k, v in rank0.items() if k != "none")  # rank 0 generated everything
    # none: the other node has no code and is told how to fix it; rank 0 fails with it (no hang)
    assert rank1["none"][0] == "error" and "broadcast_strategy='all'" in rank1["none"][2]
    assert rank0["none"] == rank1["none"] and "node 1 (rank 1" in rank0["none"][2]
    # all: code and weights arrive; the weights are rank 0's
    assert rank1["all"][0] == "weights" and torch.equal(rank1["all"][1], rank0["all"][1])
    # no_weights and code: the code arrives but not the initial weights
    for strategy in ("no_weights", "code"):
        kind, err_type, message, listing = rank1[strategy]
        assert kind == "no weights" and "fullmodel.safetensors" in message, rank1[strategy]
        assert "gencode1.py" in listing and "fullmodel.safetensors" not in listing
    assert "graph.json" in rank1["no_weights"][3] and "graph.json" not in rank1["code"][3]


@pytest.mark.multiprocess
def test_rank0_failure_is_raised_on_every_rank(tmp_path):
    results = run_workers(rank0_failure, 2, str(tmp_path), timeout=120)
    # rank 0 raises the policy's error (as a PlanError naming the policy, or as is); the others
    # a GenerationError carrying it
    assert "ValueError: this policy refuses the graph" in results[0][0]
    assert results[1][0].startswith("GenerationError: rank 0 failed to generate code: ")
    assert "this policy refuses the graph" in results[1][0]
    assert results[0][1] == results[1][1] == "ok"
