"""Python-level randomness and clock reads in forward (issue 26): refused in training mode, naming the
line and the fix; warned about in eval mode. Before, the value drawn while tracing was baked in."""
from __future__ import annotations

import datetime
import random
import time
from datetime import datetime as dt_class

import numpy as np
import pytest
import torch
import torch.nn as nn
from numpy.random import rand as np_rand

from nnscaler import ComputeConfig, parallelize
from nnscaler.ir import TraceError, TracingWarning, trace


class StochasticDepth(nn.Module):
    """The issue's model: the residual branch runs with probability 0.5 in training."""

    def __init__(self, draw=None):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 8)
        self.draw = draw or (lambda: random.random())

    def forward(self, x):
        h = self.fc(x)
        if self.training and self.draw() < 0.5:
            h = h + self.fc2(h)
        return h.sum()


class TorchDepth(StochasticDepth):
    def forward(self, x):
        h = self.fc(x)
        if self.training and torch.rand(()) < 0.5:  # the fix the error names
            h = h + self.fc2(h)
        return h.sum()


class LayerDrop(StochasticDepth):
    """wav2vec2's pattern: the probability is drawn in every mode, used only in training."""

    def forward(self, x):
        p = np.random.random()
        h = self.fc(x)
        if not self.training or p > 0.1:
            h = h + self.fc2(h)
        return h.sum()


StochasticDepth.__module__ = TorchDepth.__module__ = LayerDrop.__module__ = __name__
X = {"x": torch.randn(4, 8)}
EPOCH = dt_class(2020, 1, 1)


def _cfg():
    return ComputeConfig(1, 1, trace_strategy="cpu")


@pytest.mark.parametrize("draw, shown", [
    (lambda: random.random(), "random.random()"),
    (lambda: random.uniform(0, 1), "random.uniform()"),
    (lambda: np.random.rand(), "numpy.random.rand()"),
    (lambda: np_rand(), "numpy.random.rand()"),  # `from numpy.random import rand` in the model's module
    (lambda: time.time() % 1, "time.time()"),
    (lambda: time.perf_counter() % 1, "time.perf_counter()"),
    (lambda: datetime.datetime.now().microsecond / 1e6, "datetime.now()"),
    (lambda: dt_class.now().microsecond / 1e6, "datetime.now()"),  # `from datetime import datetime`
])
def test_training_mode_draw_is_refused_naming_the_line_and_the_fix(tmp_path, draw, shown):
    originals = (random.random, np.random.rand, time.time, datetime.datetime, np_rand, dt_class)
    with pytest.raises(TraceError) as info:
        parallelize(StochasticDepth(draw), X, "dp", _cfg(), gen_savedir=tmp_path)
    msg = str(info.value)
    assert f"({shown}) at {__file__}:" in msg
    assert "(`(lambda:" in msg  # the line that called it: the lambda above
    if "random" in shown:
        assert msg.startswith("forward draws a Python random number") and "torch.rand(()) < p" in msg
    else:
        assert msg.startswith("forward reads the clock") and "outside forward" in msg
    # every function is put back
    assert (random.random, np.random.rand, time.time, datetime.datetime, np_rand, dt_class) == originals
    assert globals()["np_rand"] is np_rand and not hasattr(random.random, "__nnscaler_watched__")


def test_the_issue_model_names_its_if_line(tmp_path):
    with pytest.raises(TraceError, match=r"\(random.random\(\)\) at .*test_python_randomness.py:\d+ in "
                                         r"StochasticDepth.__init__.<locals>.<lambda>"):
        parallelize(StochasticDepth(), X, "dp", _cfg(), gen_savedir=tmp_path)


def test_torch_draw_gives_both_branches(tmp_path):
    """The fix the message names: the program draws at every step (before: one loss for 20 calls)."""
    torch.manual_seed(0)
    with pytest.warns(TracingWarning, match="both branches are generated"):
        pm = parallelize(TorchDepth(), X, "dp", _cfg(), gen_savedir=tmp_path)
    x = torch.randn(4, 8)
    assert len({round(pm(x).item(), 5) for _ in range(20)}) == 2


def test_eval_mode_draw_warns_and_training_is_refused_later(tmp_path):
    model = LayerDrop().eval()
    with pytest.warns(TracingWarning, match=r"numpy.random.random\(\)\) at .*test_python_randomness.py:\d+ in "
                                            r"LayerDrop.forward \(`p = np.random.random\(\)`\) \(in eval mode\)"):
        pm = parallelize(model, X, "dp", _cfg(), gen_savedir=tmp_path)
    x = torch.randn(4, 8)
    torch.testing.assert_close(pm(x), model(x))
    with pytest.raises(Exception, match=r"forward draws a Python random number \(numpy.random.random\(\)\)"):
        pm.train()(x)


def test_standard_library_draws_are_not_the_models():
    """Only calls from the user's code count: the standard library may use random/time for itself."""
    import logging

    class Temp(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            logging.makeLogRecord({})  # reads time.time_ns() inside the standard library
            return self.fc(x).sum()

    trace(Temp(), X)


def test_seeded_numpy_generator_and_other_threads_are_not_refused():
    """default_rng(seed) gives the same numbers on every call (baking them is right); a draw on
    another thread while the forward is traced (a data loader) is not the forward's."""
    import threading

    drawn = []

    class Seeded(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            scale = float(np.random.default_rng(0).random()) + float(np.random.default_rng(seed=1).random())
            assert isinstance(EPOCH, datetime.datetime) and isinstance(EPOCH, dt_class)  # made before the swap
            worker = threading.Thread(target=lambda: drawn.append(random.random()))
            worker.start()
            worker.join()
            return self.fc(x).sum() * scale

    trace(Seeded(), X)
    assert drawn  # the thread drew, nothing was refused
    with pytest.raises(TraceError, match=r"numpy.random.default_rng\(\)"):
        trace(StochasticDepth(lambda: np.random.default_rng().random()), X)
