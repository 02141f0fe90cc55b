"""The later traces of a forward (the other mode, flipped decisions) take the first trace's results
where they cannot differ (nnscaler.ir.tracer.replay): the graph is the one running every call gives
(``trace(..., replay=False)``), on models whose later traces share calls, values read in Python
(guards), in-place writes, running statistics, random ops and results that are their input."""
from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import nnscaler.ir.tracer.trace as trace_module
from nnscaler.ir import trace
from nnscaler.ir.tracer import replay
from nnscaler.ir.tracer.replay import CallResults

from gpt import GPT, GPTConfig, random_batch
from guard_models import AssertMask, HFMaskAttention, ItemScale, LoopDecisions, MaskBranch, mask_batch
from mode_models import Branchy, DropNorm, TeacherStudent


class InputWrittenInPlace(nn.Module):
    """The first trace writes the example input: the next starts from other values."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        x.add_(1.0)
        k = (x * 2).sum().item()  # a value read: the traced value is in the graph
        return h.sum() * k


class ReadsRunningStats(nn.Module):
    """Batch norm updates its running mean without a version bump; the forward reads it."""

    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x):
        h = self.bn(x)
        return h.sum() + self.bn.running_mean.abs().sum().item()


class WritesThroughData(nn.Module):
    """A buffer written through ``.data`` (no version bump), read before and after, in training only."""

    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.ones(4))

    def forward(self, x):
        before = (x * self.scale).sum().item()
        if self.training:
            self.scale.data.mul_(3.0)
        return (x * self.scale).sum() + before + (self.scale * 2).sum().item()


class InPlaceOnIntermediates(nn.Module):
    """Writes to an intermediate and to the base of a view, then reads values."""

    def forward(self, x):
        h = x * 2
        v = h[0]
        first = v.sum().item()
        h.mul_(3.0)
        h.add_(1.0) if self.training else h.sub_(1.0)
        return h.sum() + first + v.sum().item()


class RandomAndIdentity(nn.Module):
    """Random ops (one drawing in training mode only, so a later draw differs between the modes),
    casts that return their input, dropout with p=0, a structseq result."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x.float())  # float32 already: x itself
        h = F.dropout(h, 0.0, self.training)  # returns h itself in both modes
        d = F.dropout(h, 0.5, self.training)  # draws in training mode only
        noise = torch.rand(64)  # constant arguments only: another draw in each mode
        best = torch.max(h + noise[:4], dim=1)
        return best.values.sum() + d.sum() + h.contiguous().sum() + noise.sum().item()


def _gpt():
    cfg = GPTConfig(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=8)
    torch.manual_seed(0)
    return GPT(cfg), random_batch(0, 2, cfg)


CASES = {
    "gpt": _gpt,
    "drop_norm": lambda: (DropNorm(), {"x": torch.randn(3, 4)}),
    "branchy": lambda: (Branchy(), {"x": torch.randn(3, 4)}),
    "teacher_student": lambda: (TeacherStudent(), {"x": torch.randn(3, 4)}),
    "mask_branch": lambda: (MaskBranch(), {"x": torch.randn(2, 8), "mask": torch.ones(2, 8)}),
    "item_scale": lambda: (ItemScale(), {"x": torch.randn(2, 8), "n": torch.tensor([3.0, 5.0])}),
    "hf_mask": lambda: (HFMaskAttention(), mask_batch(0, 2, True)),
    "assert_mask": lambda: (AssertMask(), {"x": torch.randn(2, 8), "mask": torch.ones(2, 8)}),
    "loop_decisions": lambda: (LoopDecisions(), {"x": torch.randn(2, 3)}),
    "input_written": lambda: (InputWrittenInPlace(), {"x": torch.randn(3, 4)}),
    "running_stats": lambda: (ReadsRunningStats(), {"x": torch.randn(3, 4)}),
    "data_write": lambda: (WritesThroughData(), {"x": torch.randn(3, 4)}),
    "in_place": lambda: (InPlaceOnIntermediates(), {"x": torch.randn(3, 4)}),
    "random_identity": lambda: (RandomAndIdentity(), {"x": torch.randn(3, 4)}),
}


def _traced(case, replay_on, train=True):
    torch.manual_seed(1)
    model, args = CASES[case]()
    model.train(train)
    args = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            graph = trace(model, args, replay=replay_on)
        except Exception as e:  # the same refusal either way
            return f"{type(e).__name__}: {e}"
    return json.dumps(graph.to_json(), sort_keys=True, default=str)


@pytest.fixture
def sides(monkeypatch):
    """Every CallResults a trace makes (the first trace's, then each later trace's)."""
    made = []

    class Watched(CallResults):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

        def next_trace(self):
            return Watched(self._store)

    monkeypatch.setattr(trace_module, "CallResults", Watched)
    return made


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_graph_is_the_one_running_every_call_gives(case, train):
    assert _traced(case, True, train) == _traced(case, False, train)


def test_the_other_mode_runs_no_kernel_of_a_model_that_does_not_depend_on_it(sides, monkeypatch):
    model, args = _gpt()
    ran = []
    real_run = trace_module.ExecutionDevice.run
    monkeypatch.setattr(trace_module.ExecutionDevice, "run", lambda self, *a, **k: ran.append(a[0]) or real_run(self, *a, **k))
    trace(model, args, both_modes=False, replay=False)
    one_trace = len(ran)
    ran.clear()
    trace(model, args)
    first, other = sides[-2:]
    assert not first.replaying and other.replaying
    assert first.stored > 50 and other.taken == first.stored
    # the other mode ran only what it could not take: shape reads and the like, no op
    assert len(ran) == one_trace + (one_trace - first.stored)
    assert len(ran) < 1.2 * one_trace


def test_flipped_decisions_take_the_calls_before_the_flip(sides):
    model, args = MaskBranch(), {"x": torch.randn(2, 8), "mask": torch.ones(2, 8)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = trace(model, args, both_modes=False)
    assert any(n.branch for n in graph.nodes)  # the other branch was traced
    first, flipped = sides[-2:]
    assert flipped.replaying and flipped.taken >= 1  # fc(x) before the decision


def test_a_result_written_after_it_was_made_is_not_taken():
    results = CallResults()
    x = torch.randn(3)
    results.start([x], restored=False)
    key = results.key(torch.Tensor.mul, "torch.Tensor.mul", (x, 2.0), {})
    y = x * 2.0
    results.after(key, "torch.Tensor.mul", (x, 2.0), {id(x): (x, x._version)}, y, y, None, True)
    y.add_(1.0)  # the first trace wrote it later
    later = results.next_trace()
    later.start([x], restored=False)
    assert later.take(later.key(torch.Tensor.mul, "torch.Tensor.mul", (x, 2.0), {})) is replay.MISS


def test_an_input_the_first_trace_wrote_is_another_tensor_for_the_next():
    results = CallResults()
    x = torch.randn(3)
    results.start([x], restored=False)
    assert results.key(torch.neg, "torch.neg", (x,), {}) is not None
    x.add_(1.0)  # not put back: example inputs are the caller's
    later = results.next_trace()
    later.start([x], restored=False)
    assert later.key(torch.neg, "torch.neg", (x,), {}) is None


def test_a_parameter_put_back_is_the_same_tensor_for_the_next_trace():
    results = CallResults()
    w = torch.randn(3)
    results.start([w], restored=True)
    first_key = results.key(torch.neg, "torch.neg", (w,), {})
    w.add_(1.0)
    w.sub_(1.0)  # put back between the traces (trace_state.SavedState): its version moved on
    later = results.next_trace()
    later.start([w], restored=True)
    assert later.key(torch.neg, "torch.neg", (w,), {}) == first_key


@pytest.mark.parametrize("args, kwargs", [
    ((torch.randn(2),), {}),                       # a tensor nobody named (not an input, not a result)
    ((lambda t: t,), {}),                          # an arbitrary object
])
def test_calls_that_cannot_be_named_exactly_run(args, kwargs):
    assert CallResults().key(torch.neg, "torch.neg", args, kwargs) is None


def test_random_calls_run():
    results = CallResults()
    x = torch.randn(3)
    results.start([x], restored=False)
    assert results.key(torch.rand_like, "torch.rand_like", (x,), {}) is None
    sdpa = "torch.nn.functional.scaled_dot_product_attention"
    assert results.key(F.scaled_dot_product_attention, sdpa, (x, x, x), {"dropout_p": 0.1}) is None
    assert results.key(F.scaled_dot_product_attention, sdpa, (x, x, x), {"dropout_p": 0.0}) is not None


def test_constants_are_typed_in_the_key():
    results = CallResults()
    x = torch.randn(3)
    results.start([x], restored=False)
    keys = {results.key(torch.Tensor.add, "torch.Tensor.add", (x, c), {}) for c in (1, 1.0, True, -0.0, 0.0)}
    assert len(keys) == 5


def test_the_first_trace_keeps_at_most_max_bytes(monkeypatch):
    monkeypatch.setattr(replay, "MAX_BYTES", 16)
    results = CallResults()
    x = torch.randn(8)  # 32 bytes per result
    results.start([x], restored=False)
    for _ in range(3):
        key = results.key(torch.neg, "torch.neg", (x,), {})
        y = torch.neg(x)
        results.after(key, "torch.neg", (x,), {id(x): (x, x._version)}, y, y, None, True)
    assert results.stored == 1
