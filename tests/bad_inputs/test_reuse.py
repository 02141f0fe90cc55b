"""Reuse of generated code: a model edited since generation (same config) under reuse='match', and a
broken policy after a good generation. (Every ReuseType case: tests/runtime/test_reuse_sources.py.)"""
from __future__ import annotations

import hashlib
import importlib
import shutil
import sys
import uuid

import pytest
import torch

from nnscaler import ComputeConfig, parallelize
from nnscaler.runtime.driver.gen_dir import instance_dir
from nnscaler.runtime import SourceChangedWarning

MODEL = '''
import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return torch.{act}(self.fc(x)).sum()
'''

X = torch.linspace(-1, 1, 8).reshape(2, 4)


@pytest.fixture
def model_file(tmp_path):
    name = f"bad_reuse_{uuid.uuid4().hex[:8]}"
    path = tmp_path / f"{name}.py"
    sys.path.insert(0, str(tmp_path))

    def load(act):
        path.write_text(MODEL.format(act=act))
        shutil.rmtree(tmp_path / "__pycache__", ignore_errors=True)
        sys.modules.pop(name, None)
        importlib.invalidate_caches()
        torch.manual_seed(0)
        return importlib.import_module(name).Block()

    yield path, load
    sys.path.remove(str(tmp_path))
    sys.modules.pop(name, None)


def _parallelize(model, savedir, reuse="match", policy="dp"):
    return parallelize(model, {"x": X}, policy, ComputeConfig(1, 1, trace_strategy="cpu"),
                       gen_savedir=savedir, reuse=reuse)


def test_edited_forward_under_match_warns_naming_the_file(model_file, tmp_path):
    path, load = model_file
    _parallelize(load("relu"), tmp_path / "gen")
    with pytest.warns(SourceChangedWarning) as record:
        _parallelize(load("tanh"), tmp_path / "gen")  # relu -> tanh, same config
    [w] = [w for w in record if w.category is SourceChangedWarning]
    assert w.filename == __file__  # the user's parallelize line, not nnscaler's
    assert str(path) in str(w.message) and "reuse='moo'" in str(w.message)


def _broken_policy(graph, compute_config):
    return None  # forgot to return the graph


def test_broken_policy_after_a_good_generation_keeps_the_code(model_file, tmp_path):
    _, load = model_file
    model = load("relu")
    expected = model(X).item()
    _parallelize(model, tmp_path / "gen")
    directory = next(p for p in (tmp_path / "gen").iterdir()) / "_"
    assert directory == instance_dir(tmp_path / "gen", f"{type(model).__module__}.Block", None)
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in directory.iterdir()}
    with pytest.raises(Exception, match="_broken_policy"):  # the error names the user's policy
        _parallelize(model, tmp_path / "gen", reuse="override", policy=_broken_policy)
    after = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in directory.iterdir()}
    assert after == before
    assert _parallelize(model, tmp_path / "gen")(X).item() == pytest.approx(expected, rel=1e-6)
