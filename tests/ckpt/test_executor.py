"""A save is a plan (`plan.SavePlan`, agreed by the ranks) executed by one writer
(`executor.execute`), whichever way the ranks meet: over the process group (`save`) or through
markers in the staging directory (`async_save`'s background processes). What is in flight is
owned by one object (`inflight.OWNER`)."""
from __future__ import annotations

import dataclasses
import importlib
import os
import random
import threading
import types

import numpy as np

import pytest
import torch

import nnscaler.ckpt as ckpt
from fake_modules import trained
from nnscaler.ckpt import load, verify
from nnscaler.ckpt.executor import execute
from nnscaler.ckpt.inflight import OWNER, InFlight
from nnscaler.ckpt.plan import SavePlan, plan_save
from nnscaler.ckpt.rendezvous import Collective, Markers, done_marker

RANK0 = "rank-00000-of-00001.safetensors"


def _seed():
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)


def _files(ck):
    return {n: (ck / n).read_bytes() for n in sorted(os.listdir(ck)) if n != "manifest.json"}


def test_a_plan_travels_as_json(tmp_path):
    pm, opt = trained()
    plan, tensors = plan_save(tmp_path / "ck", pm, opt, extra={"t": torch.arange(2)}, files={"a.yaml": b"x"},
                              tag=True)
    assert SavePlan.from_json(plan.to_json()) == plan
    assert [k for k, _ in tensors] == [k for k, _, _ in plan.specs] and plan.metadata["nnscaler_save"] == plan.token
    assert plan.file_names() == [RANK0, "a.yaml"] and plan.manifest.files == {}
    plan.staging.discard()


@pytest.mark.parametrize("meeting", [Collective, Markers])
def test_one_writer_commits_the_same_checkpoint_either_way(tmp_path, meeting):
    pm, opt = trained()
    _seed()  # the RNG states are saved too
    plan, tensors = plan_save(tmp_path / "ck", pm, opt, extra={"step": 3}, files={"a.yaml": "x: 1\n"})
    assert execute(plan, tensors, meeting()) is None
    assert set(verify(tmp_path / "ck").files) == {RANK0, "a.yaml"} and os.listdir(tmp_path) == ["ck"]
    pm2, opt2 = trained(seed=5, steps=1)
    assert load(tmp_path / "ck", pm2, opt2) == {"step": 3}
    _seed()
    ckpt.save(tmp_path / "ref", pm, opt, extra={"step": 3}, files={"a.yaml": "x: 1\n"})
    assert _files(tmp_path / "ck") == _files(tmp_path / "ref")


def test_a_rank_whose_marker_never_comes_is_named_and_nothing_is_committed(tmp_path):
    pm, _ = trained()
    plan, tensors = plan_save(tmp_path / "ck", pm)
    plan = dataclasses.replace(plan, world=3, timeout=0.05)  # ranks 1 and 2 never write theirs
    error = execute(plan, tensors, Markers())
    assert "ranks 1, 2 did not write their files" in error and "previous checkpoint is intact" in error
    assert os.listdir(tmp_path) == []  # the staging directory is gone


def test_a_rank_reports_its_own_write_error_without_waiting(tmp_path, monkeypatch):
    executor = importlib.import_module("nnscaler.ckpt.executor")
    pm, _ = trained()
    plan, tensors = plan_save(tmp_path / "ck", pm)

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(executor, "write_record", full)
    other = dataclasses.replace(plan, rank=1, world=2, file="rank-00001-of-00002.safetensors", timeout=30)
    error = execute(other, tensors, Markers())  # returns at once: it does not wait for rank 0
    assert error.startswith("rank 1 could not write") and "No space left" in error
    assert done_marker(plan.staging.path, 1).is_file()  # rank 0 learns it from the marker
    plan.staging.discard()


def test_the_owner_settles_the_after_commit_work_and_a_fork_owns_nothing():
    owner = InFlight()
    release, ran = threading.Event(), []
    owner.run_after_commit(lambda: (release.wait(), ran.append(1)))
    owner.handle = types.SimpleNamespace(join=lambda: ran.append("async"))
    release.set()
    owner.settle()
    assert sorted(map(str, ran)) == ["1", "async"] and owner.handle is None and owner.after_commit_thread is None
    owner.run_after_commit(lambda: None)
    owner.forget()
    assert owner.after_commit_thread is None and owner.background.proc is None


def test_the_owner_is_the_only_module_level_state():
    """No module of the package holds an object of the package's own classes (or a thread, a
    process) at module level, but the in-flight owner."""
    import pkgutil
    import subprocess
    found = []
    for info in pkgutil.iter_modules(ckpt.__path__):
        if info.name == "cli":  # typer and rich: the CLI extra
            continue
        module = importlib.import_module(f"nnscaler.ckpt.{info.name}")
        for name, value in vars(module).items():
            if isinstance(value, (type, types.ModuleType, types.FunctionType)) or value is OWNER:
                continue
            if type(value).__module__.startswith("nnscaler.ckpt") or isinstance(value, (threading.Thread,
                                                                                        subprocess.Popen)):
                found.append(f"{info.name}.{name}")
    assert found == []
