"""A user's own pipeline policy built from the primitives (stage, schedule, replicate, assign):
an int made in stage 0 crosses to stage 1, micro-batch shapes may change between steps, and
every rank returns the same outputs as the single-device model (2 gloo processes)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from launch import run_workers


class ShapeAcross(nn.Module):
    """Stage 1 reshapes with a size read in stage 0."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        n = x.size(0)
        h = torch.relu(self.a(x))
        return self.b(h).view(n, -1).sum(), h.mean()


def two_stage_policy(graph, cfg):
    from nnscaler.policies import assign, replicate, schedule, stage
    lead = next(i for i, n in enumerate(graph.nodes) if n.module_path == "b")
    stage(graph, [lead])
    schedule(graph, nmicros=2, scheduler="1f1b", pp_size=2, tp_size=1)
    for node in graph.nodes:
        for piece in replicate(graph, node, 1):
            assign(piece, node.stage)
    return graph


def _worker(rank, world, gen_dir):
    from nnscaler import ComputeConfig, parallelize
    torch.manual_seed(0)
    model = ShapeAcross()
    pm = parallelize(model, {"x": torch.randn(3, 4)}, two_stage_policy,
                     ComputeConfig(2, 2, use_end2end=True, trace_strategy="cpu"), gen_savedir=gen_dir)
    results = []
    for rows in (3, 5):  # the second step's micro-batches have another shape than the traced one
        xs = [torch.randn(rows, 4, generator=torch.Generator().manual_seed(10 * rows + i)) for i in range(2)]
        for p in model.parameters():
            p.grad = None
        ref = [model(x) for x in xs]
        sum(r[0] for r in ref).backward()
        got = pm.train_step(xs)
        grads = {e.full_name: getattr(pm, local).grad.clone() for local, e in pm.fullmap.items()
                 if getattr(pm, local).grad is not None}
        results.append(([[t.item() for t in g] for g in got], [[t.item() for t in r] for r in ref],
                        grads, {n: p.grad.clone() for n, p in model.named_parameters()}))
        pm.zero_grad()
    return results


@pytest.mark.multiprocess
def test_user_policy_pipeline_with_int_crossing_and_new_shapes(tmp_path):
    results = run_workers(_worker, 2, str(tmp_path / "gen"), timeout=200)
    held = set()
    for rank, per_rank in enumerate(results):
        for got, ref, grads, ref_grads in per_rank:
            for g, r in zip(got, ref):  # every rank returns every output of every micro-batch
                assert g == pytest.approx(r, abs=1e-6)
            for name, grad in grads.items():
                assert torch.allclose(grad, ref_grads[name], atol=1e-6), (rank, name)
                held.add(name)
    assert held == {"a.weight", "a.bias", "b.weight", "b.bias"}
