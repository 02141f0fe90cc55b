"""tools/matrix_run.py's one-process reference (fast tier, no processes): for a model with an
auxiliary load-balancing loss, `_per_replica_loss` takes that loss per data-parallel replica's
micro-batch, which is `tests/models/test_moe_parity.py`'s per-replica reference (gradient
accumulation over the replicas' parts, each loss / dp), in float64."""
from __future__ import annotations

import os
import sys

import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(_ROOT, "tools"))

import matrix_run  # noqa: E402  (puts tests/models on the path)
import hf_models  # noqa: E402


def _grads(model):
    return {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}


def _run(fn, model):
    model.zero_grad()
    loss = fn()
    loss.backward()
    return loss.detach(), _grads(model)


def test_per_replica_loss_is_the_replicas_mean():
    model = hf_models.make("mixtral", torch.float64)
    batch = hf_models.batch("mixtral", 0, 4, torch.float64, pad=True)
    halves = [{k: v[i * 2:(i + 1) * 2] for k, v in batch.items()} for i in range(2)]
    got, got_g = _run(lambda: matrix_run._per_replica_loss(model, batch, 2), model)
    want, want_g = _run(lambda: sum(model(**h) for h in halves) / 2, model)
    whole, _ = _run(lambda: model(**batch), model)
    assert abs(got - want) <= 1e-12, (got, want)
    assert abs(got - whole) > 1e-6  # the global batch's aux loss is another number: the test can fail
    assert got_g.keys() == want_g.keys() and got_g
    for k in want_g:
        assert (got_g[k] - want_g[k]).abs().max() <= 1e-12, k


def test_per_replica_loss_of_one_replica_is_the_model():
    model = hf_models.make("qwen3_moe", torch.float64)
    batch = hf_models.batch("qwen3_moe", 1, 4, torch.float64)
    got, want = matrix_run._per_replica_loss(model, batch, 1), model(**batch)
    assert abs(got.item() - want.item()) <= 1e-12
