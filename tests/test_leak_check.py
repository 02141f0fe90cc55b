"""The checks of tests/conftest.py find what they are meant to find (and clean it up)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

CONFTEST = Path(__file__).resolve().with_name("conftest.py")


@pytest.fixture(scope="module")
def conftest(request):
    """The tests/conftest.py module pytest loaded (found among its plugins: other folders'
    conftest.py files take the name `conftest` in sys.modules after it)."""
    for plugin in request.config.pluginmanager.get_plugins():
        if getattr(plugin, "__file__", None) and Path(plugin.__file__).resolve() == CONFTEST:
            return plugin
    pytest.fail("tests/conftest.py is not loaded as a plugin")


def test_subprocesses_that_run_python_are_told_apart_from_system_tools(conftest):
    assert conftest._runs_python(sys.executable)
    assert conftest._runs_python("python3")
    assert not conftest._runs_python("uname")  # what platform.processor() runs
    script = Path(sys.executable).with_name("torchrun")
    if script.exists():
        assert conftest._runs_python(str(script))  # a console script: a python shebang


@pytest.mark.multiprocess
def test_a_live_child_is_found_until_it_is_gone(conftest):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert child.pid in conftest._session_processes()
    finally:
        child.kill()
        child.wait()
    assert child.pid not in conftest._session_processes()


def test_an_initialised_default_group_is_reported_and_destroyed(conftest):
    import torch.distributed as dist
    assert conftest._leaked_groups() == []
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    problems = conftest._leaked_groups()
    assert len(problems) == 1 and "default process group" in problems[0]
    assert not dist.is_initialized()


def test_a_registry_entry_is_reported_and_emptied(conftest):
    import nnscaler.runtime.grid as grid
    grid._GROUPS[(0, 3)] = object()
    problems = conftest._leaked_groups()
    assert len(problems) == 1 and "(0, 3)" in problems[0]
    assert not grid._GROUPS


def test_new_files_count_unless_people_write_them(conftest):
    root = conftest.ROOT
    assert not conftest._hand_written(str(root / ".nnscaler" / "x" / "gencode0.py"))
    assert not conftest._hand_written(str(root / "tests" / "gencode0.py"))
    assert not conftest._hand_written(str(root / "tests" / "runtime" / "rank0.json"))
    assert not conftest._hand_written(str(root / "fullmodel.safetensors"))
    assert conftest._hand_written(str(root / "tests" / "ckpt" / "test_new.py"))
    assert conftest._hand_written(str(root / "runs" / "gpt_char" / "checkpoints" / "last" / "manifest.json"))  # README
    assert not conftest._hand_written(str(root / "tests" / "runs" / "x.json"))
    assert conftest._hand_written(str(root / "packages" / "nnscaler-ir" / "src" / "nnscaler" / "ir" / "x.json"))
    probe = root / f"leak_probe_{os.getpid()}.bin"
    before = conftest._tree(set())
    probe.write_bytes(b"x")
    try:
        assert str(probe) in conftest._tree(set()) - before
    finally:
        probe.unlink()


def test_the_session_never_touches_the_users_caches(conftest):
    """Every cache a test could fill (autodist's profiles, Hugging Face, torch, W&B, XDG) points
    into the session's temporary directory, not under the user's home."""
    from nnscaler.policies.autodist.op_profile import cache_dir

    home = Path.home().resolve()
    session = Path(conftest._SESSION_TMP).resolve()
    for var, path in conftest.CACHE_VARS.items():
        resolved = Path(os.environ[var]).resolve()
        assert resolved == Path(path).resolve(), var
        assert session in resolved.parents, (var, resolved)
        assert home not in resolved.parents or home in session.parents, (var, resolved)
    assert session in cache_dir().resolve().parents
    assert os.environ["HF_HUB_OFFLINE"] == "1"
