"""How errors are shown: a deliberate one is a single message (traceback cut at the user's call), an
internal one and one raised by the user's own code keep their traceback."""
from __future__ import annotations

import importlib
import traceback

import pytest
import torch
import torch.nn as nn

from nnscaler import ComputeConfig, parallelize
from nnscaler.runtime.driver.error_display import is_deliberate

parallelize_module = importlib.import_module("nnscaler.runtime.driver.parallelize")


class RaisesInForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        raise ValueError("the user's own check failed")


RaisesInForward.__module__ = __name__


def _frames(exc):
    return [f.filename for f in traceback.extract_tb(exc.__traceback__)]


def test_deliberate_error_is_one_message(tmp_path):
    with pytest.raises(ValueError, match=r"instance_name must be a non-empty name") as info:
        parallelize(RaisesInForward(), {"x": torch.randn(2, 4)}, "dp", ComputeConfig(1, 1), gen_savedir=tmp_path,
                    instance_name="a/b")
    assert _frames(info.value)[-1] == parallelize_module.__file__  # nothing below the user's call


def test_users_own_error_keeps_its_traceback(tmp_path):
    with pytest.raises(ValueError, match="the user's own check failed") as info:
        parallelize(RaisesInForward(), {"x": torch.randn(2, 4)}, "dp", ComputeConfig(1, 1, trace_strategy="cpu"),
                    gen_savedir=tmp_path)
    assert _frames(info.value)[-1] == __file__  # the user's raise is shown


def _raised_at(filename: str, lineno: int, statement: str) -> BaseException:
    """An exception raised by `statement` executing as line `lineno` of `filename`."""
    code = compile("\n" * (lineno - 1) + statement, filename, "exec")
    try:
        exec(code, {})
    except Exception as e:  # noqa: BLE001
        return e
    raise AssertionError("did not raise")


def _line(path, predicate):
    with open(path) as f:
        return next(i for i, line in enumerate(f, 1) if predicate(line.strip()))


def test_internal_failure_in_nnscaler_code_is_not_deliberate():
    path = parallelize_module.__file__
    raise_line = _line(path, lambda s: s.startswith("raise TypeError("))
    other_line = _line(path, lambda s: s.startswith("rank, world = "))
    assert is_deliberate(_raised_at(path, raise_line, "raise TypeError('checked')"))
    assert not is_deliberate(_raised_at(path, other_line, "int(None)"))  # a bug: keep the traceback
    assert not is_deliberate(_raised_at(__file__, 1, "raise ValueError('user')"))  # the user's raise
    assert not is_deliberate(_raised_at(torch.__file__, 1, "raise ValueError('torch')"))


def test_nnscaler_exception_classes_are_deliberate():
    from nnscaler.ir import TraceError
    from nnscaler.runtime.errors import GenerationError
    assert is_deliberate(TraceError("x")) and is_deliberate(GenerationError("x"))
    assert not is_deliberate(KeyError("x"))
