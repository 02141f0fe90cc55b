"""The one gradient-ready rule (`nnscaler.runtime.grad_ready.BackwardPass`) the Reducer and the
fully sharded parameters share: decided once per backward pass at its first gradient, the end of
the pass queued on the autograd engine, a pass that raised closed by the next one."""
from __future__ import annotations

import pytest
import torch

from nnscaler.runtime.grad_ready import BackwardPass, graph_task_id
from nnscaler.runtime.reducer import Pausable


class Owner(Pausable):
    def __init__(self):
        self.events, self.answers = [], []
        self.passes = BackwardPass(lambda: self.sync_enabled, lambda sync, reduce: self.events.append(("end", sync, reduce)),
                                   lambda: self.events.append("start"))

    def hook(self, grad):
        self.answers.append(self.passes.enter())
        return grad


def _graph(owner, fail=False):
    x = torch.ones(3, requires_grad=True)
    y = (x * 2).sum() + (x * 3).sum()
    x.register_hook(owner.hook)
    if fail:
        def boom(grad):
            raise RuntimeError("boom")
        x.register_hook(boom)
    return y


def test_decided_once_per_pass_and_ended_by_the_engine():
    owner = Owner()
    assert graph_task_id() == -1
    _graph(owner).backward()
    assert owner.events == ["start", ("end", True, True)] and owner.answers == [True]
    with owner.no_sync():
        y = _graph(owner)
        y.backward()
    assert owner.events[2:] == ["start", ("end", False, True)] and owner.answers[1:] == [False]
    assert not owner.passes.active


def test_the_first_gradient_decides_for_the_whole_pass():
    owner = Owner()
    x = torch.ones(2, requires_grad=True)
    a, b = x * 2, x * 3
    with owner.no_sync():  # a pass that starts paused stays local even if the pause ends inside it
        def first(grad):
            owner.passes.enter()
            owner._paused = 0
            return grad
        a.register_hook(first)
        b.register_hook(owner.hook)
        (a.sum() + b.sum()).backward()
        owner._paused = 1  # restore for the context's exit
    assert owner.answers == [False] and owner.events == ["start", ("end", False, True)]


def test_a_pass_that_raised_is_closed_without_reducing():
    owner = Owner()
    with pytest.raises(RuntimeError, match="boom"):
        _graph(owner, fail=True).backward()
    assert owner.passes.active and owner.events == ["start"]
    _graph(owner).backward()
    assert owner.events == ["start", ("end", True, False), "start", ("end", True, True)]
    with pytest.raises(RuntimeError, match="boom"):
        _graph(owner, fail=True).backward()
    owner.passes.close(reduce=False)
    assert owner.events[-1] == ("end", True, False) and not owner.passes.active
