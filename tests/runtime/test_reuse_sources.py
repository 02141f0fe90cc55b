"""ReuseType and the model's source: an edited model under `match` warns naming the file (and
reuses the old code, the seed's match is the config), `moo`/`graph` regenerate; a failed
generation (trace, policy, codegen) leaves the earlier valid code intact and reusable.

In process, on a real one-rank gloo group (`world1`)."""
from __future__ import annotations

import errno
import hashlib
import importlib
import json
import shutil
import sys
import uuid
import warnings

import pytest
import torch

from launch import world1  # noqa: F401  (fixture)
from nnscaler import ComputeConfig, parallelize
from nnscaler.runtime.driver.gen_dir import instance_dir, read_manifest, swap_in
from nnscaler.runtime import SourceChangedWarning

MODEL = '''
import torch
import torch.nn as nn


class Net(nn.Module):
    calls = 0

    def __init__(self, fail=False):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.fail = fail

    def forward(self, x):
        type(self).calls += 1
        if self.fail:
            raise RuntimeError("the user's forward failed")
        return torch.{act}(self.fc(x)).sum()
'''

X = torch.arange(8, dtype=torch.float32).reshape(2, 4) / 8 - 0.3


class UserModel:
    """A model class in a module file of tmp_path that the test can edit and re-import."""

    def __init__(self, tmp_path, act="relu"):
        self.name = f"reuse_src_{uuid.uuid4().hex[:8]}"
        self.dir = tmp_path / "src"
        self.dir.mkdir()
        self.path = self.dir / f"{self.name}.py"
        sys.path.insert(0, str(self.dir))
        self.write(act)

    def write(self, act):
        self.path.write_text(MODEL.format(act=act))
        shutil.rmtree(self.dir / "__pycache__", ignore_errors=True)  # same size, same second: no stale .pyc
        sys.modules.pop(self.name, None)
        importlib.invalidate_caches()
        self.module = importlib.import_module(self.name)
        return self.cls

    @property
    def cls(self):
        return self.module.Net

    def instance(self, **kw):
        torch.manual_seed(0)
        return self.cls(**kw)

    def close(self):
        sys.path.remove(str(self.dir))
        sys.modules.pop(self.name, None)


@pytest.fixture
def user_model(tmp_path):
    m = UserModel(tmp_path)
    yield m
    m.close()


def cfg():
    return ComputeConfig(1, 1, trace_strategy="cpu")


def run(model, savedir, reuse, policy="dp"):
    return parallelize(model, {"x": X}, policy, cfg(), gen_savedir=savedir, reuse=reuse)


def hashes(directory):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def gen_dir_of(user_model, savedir):
    return instance_dir(savedir, f"{user_model.name}.Net", None)


def source_warnings(record):
    return [w for w in record if issubclass(w.category, SourceChangedWarning)]


def test_manifest_records_the_model_file(world1, user_model, tmp_path):
    run(user_model.instance(), tmp_path / "gen", "match")
    sources = read_manifest(gen_dir_of(user_model, tmp_path / "gen"))["sources"]
    entry = {s["path"]: s for s in sources}[str(user_model.path)]
    assert entry["sha256"] == hashlib.sha256(user_model.path.read_bytes()).hexdigest()
    assert "Net" in entry["why"]
    assert not any("/torch/" in s["path"] or "/nnscaler/" in s["path"] for s in sources)


def test_match_warns_naming_the_edited_file_and_reuses_the_old_code(world1, user_model, tmp_path):
    savedir = tmp_path / "gen"
    relu_model = user_model.instance()
    expected_relu = relu_model(X).item()
    pm = run(relu_model, savedir, "match")
    assert pm(X).item() == pytest.approx(expected_relu, rel=1e-6)

    user_model.write("tanh")  # the user edits forward: relu -> tanh, same config
    tanh_model = user_model.instance()
    expected_tanh = tanh_model(X).item()
    assert abs(expected_tanh - expected_relu) > 1e-3
    calls = user_model.cls.calls
    with pytest.warns(SourceChangedWarning) as record:
        pm = run(tanh_model, savedir, "match")
    msg = str(source_warnings(record)[0].message)
    assert str(user_model.path) in msg and "changed since generation" in msg
    assert "reuse='moo'" in msg and "override" in msg
    assert source_warnings(record)[0].filename == __file__  # attributed to the user's parallelize call
    assert user_model.cls.calls == calls, "match must reuse, not trace again"
    assert pm(X).item() == pytest.approx(expected_relu, rel=1e-6)  # the old program, as documented

    # a class (no instance) is checked against the recorded files too
    with pytest.warns(SourceChangedWarning, match=str(user_model.path)):
        parallelize(user_model.cls, {"x": X}, "dp", cfg(), gen_savedir=savedir, reuse="match",
                    module_fn=user_model.instance)


def test_moo_regenerates_after_the_model_file_changed(world1, user_model, tmp_path):
    savedir = tmp_path / "gen"
    run(user_model.instance(), savedir, "moo")
    user_model.write("tanh")
    tanh_model = user_model.instance()
    expected = tanh_model(X).item()
    with warnings.catch_warnings():
        warnings.simplefilter("error", SourceChangedWarning)
        pm = run(tanh_model, savedir, "moo")
    assert pm(X).item() == pytest.approx(expected, rel=1e-6)  # the new numbers
    recorded = {s["path"]: s["sha256"] for s in read_manifest(gen_dir_of(user_model, savedir))["sources"]}
    assert recorded[str(user_model.path)] == hashlib.sha256(user_model.path.read_bytes()).hexdigest()
    # regenerated: match now reuses without a warning
    with warnings.catch_warnings():
        warnings.simplefilter("error", SourceChangedWarning)
        assert run(user_model.instance(), savedir, "match")(X).item() == pytest.approx(expected, rel=1e-6)


def test_graph_retraces_after_the_model_file_changed(world1, user_model, tmp_path):
    savedir = tmp_path / "gen"
    run(user_model.instance(), savedir, "graph")
    user_model.write("tanh")
    tanh_model = user_model.instance()
    expected = tanh_model(X).item()
    calls = user_model.cls.calls
    pm = run(tanh_model, savedir, "graph")
    assert user_model.cls.calls > calls, "graph must trace the changed model again, not keep the old graph"
    assert pm(X).item() == pytest.approx(expected, rel=1e-6)


def test_unchanged_model_reuses_without_warning(world1, user_model, tmp_path):
    savedir = tmp_path / "gen"
    run(user_model.instance(), savedir, "match")
    calls = user_model.cls.calls
    with warnings.catch_warnings():
        warnings.simplefilter("error", SourceChangedWarning)
        run(user_model.instance(), savedir, "match")
        run(user_model.instance(), savedir, "moo")
    assert user_model.cls.calls == calls


def test_runtime_only_machine_without_the_model_files_loads_the_code(world1, user_model, tmp_path, monkeypatch):
    savedir = tmp_path / "gen"
    model = user_model.instance()
    expected = model(X).item()
    run(model, savedir, "match")
    user_model.path.unlink()  # this machine has the code, not the model's files
    shutil.rmtree(user_model.dir / "__pycache__", ignore_errors=True)
    for part in ("nnscaler.codegen", "nnscaler.policies"):  # nor the compile-time packages
        monkeypatch.setitem(sys.modules, part, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SourceChangedWarning)
        pm = run(model, savedir, "match")
    assert pm(X).item() == pytest.approx(expected, rel=1e-6)


OPS = '''
import torch
from nnscaler import register_op


@register_op("a b -> a b")
def scaled(x):
    return x * {factor}
'''

OPS_MODEL = '''
import torch
import torch.nn as nn
import {ops}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return {ops}.scaled(self.fc(x)).sum()
'''


def test_match_warns_naming_an_edited_custom_op_file(world1, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    tag = uuid.uuid4().hex[:8]
    ops, model = f"reuse_ops_{tag}", f"reuse_opsmodel_{tag}"
    (src / f"{ops}.py").write_text(OPS.format(factor="2.0"))
    (src / f"{model}.py").write_text(OPS_MODEL.format(ops=ops))
    sys.path.insert(0, str(src))
    try:
        net = importlib.import_module(model).Net()
        run(net, tmp_path / "gen", "match")
        recorded = {s["path"]: s["why"] for s in read_manifest(instance_dir(tmp_path / "gen", f"{model}.Net", None))["sources"]}
        assert f"function {ops}.scaled" in recorded[str(src / f"{ops}.py")]
        (src / f"{ops}.py").write_text(OPS.format(factor="3.0"))  # the user edits the op, not the model
        with pytest.warns(SourceChangedWarning) as record:
            run(net, tmp_path / "gen", "match")
        msg = str(source_warnings(record)[0].message)
        assert str(src / f"{ops}.py") in msg and str(src / f"{model}.py") not in msg
    finally:
        sys.path.remove(str(src))
        sys.modules.pop(ops, None), sys.modules.pop(model, None)


def test_model_files_at_another_path_with_the_same_content_are_no_change(world1, user_model, tmp_path):
    savedir = tmp_path / "gen"
    run(user_model.instance(), savedir, "match")
    directory = gen_dir_of(user_model, savedir)
    manifest = json.loads((directory / "manifest.json").read_text())
    for entry in manifest["sources"]:  # as if generated from a checkout elsewhere (another node)
        entry["path"] = "/elsewhere/" + entry["path"].rsplit("/", 1)[-1]
    (directory / "manifest.json").write_text(json.dumps(manifest))
    calls = user_model.cls.calls
    with warnings.catch_warnings():
        warnings.simplefilter("error", SourceChangedWarning)
        run(user_model.instance(), savedir, "match")
        run(user_model.instance(), savedir, "moo")
    assert user_model.cls.calls == calls  # reused, not regenerated
    user_model.write("tanh")  # now the content differs from every recorded file
    with pytest.warns(SourceChangedWarning, match="not used when the code was generated"):
        run(user_model.instance(), savedir, "match")


# -- a failed generation keeps the earlier valid code ------------------------------------------------

def _failing_policy(graph, compute_config):
    raise RuntimeError("the user's policy failed")


def _assert_intact_and_reusable(user_model, savedir, before, expected):
    directory = gen_dir_of(user_model, savedir)
    assert hashes(directory) == before
    assert [p.name for p in directory.parent.iterdir()] == [directory.name]  # no temporary leftovers
    calls = user_model.cls.calls
    pm = run(user_model.instance(), savedir, "match")
    assert user_model.cls.calls == calls, "match must reuse the intact code"
    assert pm(X).item() == pytest.approx(expected, rel=1e-6)


def _generated(user_model, savedir):
    model = user_model.instance()
    expected = model(X).item()
    run(model, savedir, "match")
    return hashes(gen_dir_of(user_model, savedir)), expected


def test_failing_policy_keeps_the_earlier_code(world1, user_model, tmp_path):
    savedir = tmp_path / "gen"
    before, expected = _generated(user_model, savedir)
    assert "manifest.json" in before and "gencode0.py" in before
    with pytest.raises(Exception, match="the user's policy failed"):
        run(user_model.instance(), savedir, "override", policy=_failing_policy)
    _assert_intact_and_reusable(user_model, savedir, before, expected)


def test_failing_trace_keeps_the_earlier_code(world1, user_model, tmp_path):
    savedir = tmp_path / "gen"
    before, expected = _generated(user_model, savedir)
    with pytest.raises(Exception, match="the user's forward failed"):
        run(user_model.instance(fail=True), savedir, "override")
    _assert_intact_and_reusable(user_model, savedir, before, expected)


def test_failing_codegen_keeps_the_earlier_code(world1, user_model, tmp_path, monkeypatch):
    import nnscaler.codegen as codegen
    savedir = tmp_path / "gen"
    before, expected = _generated(user_model, savedir)
    real = codegen.generate

    def disk_full_after_one_file(graph, cfg, outdir, **kw):  # fault injection: ENOSPC mid-write
        real(graph, cfg, outdir, **kw)
        raise OSError(errno.ENOSPC, "No space left on device", str(outdir / "gencode0.py"))

    monkeypatch.setattr(codegen, "generate", disk_full_after_one_file)
    with pytest.raises(Exception, match="no space left"):
        run(user_model.instance(), savedir, "override")
    monkeypatch.setattr(codegen, "generate", real)
    _assert_intact_and_reusable(user_model, savedir, before, expected)


def test_swap_in_replaces_a_directory_whole(tmp_path):
    old, new = tmp_path / "inst", tmp_path / ".inst.generating-1"
    old.mkdir(), new.mkdir()
    (old / "gencode0.py").write_text("old")
    (old / "only_old.txt").write_text("x")
    (new / "gencode0.py").write_text("new")
    swap_in(new, old)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["inst"]
    assert sorted(p.name for p in old.iterdir()) == ["gencode0.py"] and (old / "gencode0.py").read_text() == "new"


def test_swap_in_without_an_atomic_exchange_renames_aside(tmp_path, monkeypatch):
    import nnscaler.runtime.driver.gen_dir as gen_dir
    monkeypatch.setattr(gen_dir, "exchange_paths", lambda a, b: False)  # a file system without RENAME_EXCHANGE
    old, new = tmp_path / "inst", tmp_path / ".inst.generating-2"
    old.mkdir(), new.mkdir()
    (old / "gencode0.py").write_text("old")
    (new / "gencode0.py").write_text("new")
    swap_in(new, old)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["inst"] and (old / "gencode0.py").read_text() == "new"
