"""codegen/sync_batchnorm.py: ComputeConfig.sync_batchnorm rewrites the batch norm calls of the
generated code (only those, only when asked and the data-parallel degree is above 1)."""
from __future__ import annotations

import ast

import torch
import torch.nn as nn

from nnscaler.codegen.emit import emit_rank
from nnscaler.ir import ComputeConfig, trace
from nnscaler.policies import apply_policy

from gen_ast import calls, dotted, method


class Norms(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.inorm = nn.InstanceNorm2d(4, affine=True)
        self.gnorm = nn.GroupNorm(2, 4)
        self.bn1d = nn.BatchNorm1d(4, track_running_stats=False)  # batch statistics in eval too

    def forward(self, x):
        h = self.gnorm(self.inorm(self.bn(self.conv(x))))
        return self.bn1d(h.mean((2, 3))).sum()


def _code(world, plan=1, **cfg):
    config = ComputeConfig(plan, world, trace_strategy="cpu", **cfg)
    graph = apply_policy(trace(Norms(), {"x": torch.randn(4, 2, 4, 4)}), config, "dp")
    return emit_rank(graph, config.to_dict(), 0, "dp", graph.fingerprint())


def test_batch_norm_calls_use_the_runtime_when_asked():
    forward = method(_code(2, sync_batchnorm=True), "_forward_impl")
    synced = calls(forward, "nr.sync_batchnorm.batch_norm")
    assert len(synced) == 2 and not calls(forward, "torch.nn.functional.batch_norm")
    assert all(dotted(c.args[0]) == "self" for c in synced)  # the module (its unit's group) comes first
    # the training flag stays the module's mode: eval runs plain batch norm with running statistics
    (tracked,) = [c for c in synced if "self.bn_running_mean" in map(dotted, c.args)]
    training = [k.value for k in tracked.keywords if k.arg == "training"] or tracked.args[6:7]
    assert [dotted(t) for t in training] == ["self.training"], ast.unparse(tracked)
    # per-sample norms are never rewritten
    assert calls(forward, "torch.nn.functional.instance_norm") and calls(forward, "torch.nn.functional.group_norm")


def test_default_and_single_replica_keep_plain_batch_norm():
    for text in (_code(2), _code(1, sync_batchnorm=True)):
        forward = method(text, "_forward_impl")
        assert not calls(forward, "nr.sync_batchnorm.batch_norm")
        assert len(calls(forward, "torch.nn.functional.batch_norm")) == 2
