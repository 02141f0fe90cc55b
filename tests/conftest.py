"""Shared test set-up.

* The example models are importable as `gpt` (also in spawned workers).
* **Tier enforcement.** A test that starts another process (a `multiprocessing` process, e.g.
  through `run_workers` or `mp.spawn`, or a `subprocess`, e.g. torchrun, an example script or a
  fresh interpreter) must carry `@pytest.mark.multiprocess`; one that does not fails and says
  so. The fast tier (`-m "not multiprocess"`) therefore never starts a process.
* **Leak check, on every test by default** (the autouse fixture `_leak_check`): after the test
  (and its fixtures) no process started from this pytest session is alive, no torch.distributed
  default group is initialised in the pytest process, nnscaler's group registry
  (`nnscaler.runtime.grid`) holds no process group, and no file appeared in the repository tree
  (or in the working directory when it is outside the repository). Files that people add while
  tests run are not counted: anything in a package's `src/` or in bench/results/ (benchmark
  figures; the bench tests write theirs under tmp_path), and `.py`/`.md`/`.rst`/`.toml`/`.txt`/
  `.yaml`/`.yml`/`.cfg`/`.ini`/`.sh` files under tests/, docs/, examples/, bench/, tools/ and src/
  (but never `gencode*.py`); and anything under `runs/` at the root, which the README's examples
  write (`nnscaler train -f examples/trainer/gpt_char.yaml` run in the same checkout while the
  tests run; no test writes there: they train under tmp_path). Whatever leaked is cleaned
  up (processes killed, groups destroyed, registry emptied; files are left for inspection) so
  that the next test starts clean, and the test fails with what was found.
  `@pytest.mark.allow_leaks` exempts a test (none uses it; it is there for a test that
  deliberately leaves something and cleans it up in a later test of the same module).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_EXAMPLES = str(ROOT / "examples")
if _EXAMPLES not in sys.path:
    sys.path.insert(0, _EXAMPLES)

# Every process started from this session inherits this variable (spawned interpreters and
# subprocesses copy os.environ), so it finds them even after they were re-parented (orphans).
SESSION_VAR = "NNSCALER_TEST_SESSION"
SESSION = f"{os.getpid()}-{time.time_ns()}"
os.environ[SESSION_VAR] = SESSION

# Tests never read or write the user's caches: autodist's op profiles and measured collectives
# (nnscaler.policies.autodist, NNSCALER_CACHE_DIR) and every library cache that defaults to
# ~/.cache or ~/.config (XDG, Hugging Face, torch hub/inductor/triton, W&B, matplotlib) point into
# one per-session temporary directory, shared by the session's workers, removed at exit. A
# profile measured on a loaded machine therefore never leaks into later runs, and a stale one
# from an earlier run never decides a test.
import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
_SESSION_TMP = tempfile.mkdtemp(prefix="nnscaler-test-session-")
_CACHE = os.path.join(_SESSION_TMP, "nnscaler")
CACHE_VARS = {
    "NNSCALER_CACHE_DIR": _CACHE,
    "XDG_CACHE_HOME": os.path.join(_SESSION_TMP, "xdg-cache"),
    "XDG_CONFIG_HOME": os.path.join(_SESSION_TMP, "xdg-config"),
    "HF_HOME": os.path.join(_SESSION_TMP, "huggingface"),
    "TORCH_HOME": os.path.join(_SESSION_TMP, "torch"),
    "TORCHINDUCTOR_CACHE_DIR": os.path.join(_SESSION_TMP, "inductor"),
    "TRITON_CACHE_DIR": os.path.join(_SESSION_TMP, "triton"),
    "WANDB_DIR": os.path.join(_SESSION_TMP, "wandb"),
    "WANDB_CACHE_DIR": os.path.join(_SESSION_TMP, "wandb-cache"),
    "WANDB_CONFIG_DIR": os.path.join(_SESSION_TMP, "wandb-config"),
    "WANDB_DATA_DIR": os.path.join(_SESSION_TMP, "wandb-data"),
    "MPLCONFIGDIR": os.path.join(_SESSION_TMP, "matplotlib"),
}
for _var, _path in CACHE_VARS.items():
    os.makedirs(_path, exist_ok=True)
    os.environ[_var] = _path
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded: tiny configs only
atexit.register(shutil.rmtree, _SESSION_TMP, True)
# autodist measures how the job's processes share the CPU by forking peers that run the model
# (nnscaler.policies.autodist.cpu_sharing): the fast tier starts no process, so the suite uses the
# plain division of the cores; tests/policies/test_autodist_cpu_sharing.py measures for real.
os.environ["NNSCALER_AUTODIST_CPU_SHARING"] = "plain"

PROCESS_GRACE_S = 10.0  # how long a test's processes get to exit once the test is over
# multiprocessing's own per-interpreter helpers: started once, on first use, and kept for the
# whole session by design (not a test's leftovers).
_MP_HELPERS = ("from multiprocessing.resource_tracker import main", "from multiprocessing.forkserver import main")
_SOURCE_TREES = {"tests", "docs", "examples", "bench", "tools", "src"}
_SOURCE_SUFFIXES = (".py", ".md", ".rst", ".toml", ".txt", ".yaml", ".yml", ".cfg", ".ini", ".sh")
_SKIP_DIRS = {".git", "__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache"}

# -- which tests start processes -----------------------------------------------------------------
_STARTED: list = []  # what the current test started: (kind, description)


def _runs_python(program, executable=None) -> bool:
    """Whether a subprocess runs Python (an interpreter, torchrun, a console script, a script
    with a python shebang); a system tool such as `uname` (which `platform` runs) does not count."""
    import shutil
    path = os.fsdecode(executable or program)
    name = os.path.basename(path)
    if name.startswith("python") or os.path.realpath(path) == os.path.realpath(sys.executable):
        return True
    resolved = shutil.which(path) or path
    try:
        with open(resolved, "rb") as f:
            first = f.readline(200)
    except OSError:
        return False
    return first.startswith(b"#!") and b"python" in first


def _install_spawn_recorders() -> None:
    import multiprocessing.process as mpp

    if getattr(mpp.BaseProcess.start, "_nnscaler_recorder", False):
        return
    mp_start = mpp.BaseProcess.start
    popen_init = subprocess.Popen.__init__

    def start(self, *args, **kwargs):
        _STARTED.append(("multiprocessing", f"{type(self).__name__}(target={getattr(self, '_target', None)!r})"))
        return mp_start(self, *args, **kwargs)

    def init(self, args, *rest, **kwargs):
        argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
        if (any(w in os.fsdecode(argv[0]) for w in ("python", "torchrun")) if kwargs.get("shell") and argv
                else _runs_python(argv[0] if argv else "", kwargs.get("executable"))):
            shown = " ".join(map(str, argv))
            _STARTED.append(("subprocess", shown[:200]))
        return popen_init(self, args, *rest, **kwargs)

    start._nnscaler_recorder = True
    mpp.BaseProcess.start = start
    subprocess.Popen.__init__ = init


def pytest_addoption(parser):
    parser.addoption("--update-golden", action="store_true", default=False,
                     help="rewrite the golden files under tests/golden/ from this run instead of "
                          "comparing against them (review the diff before committing it)")


def pytest_configure(config):
    config.addinivalue_line("markers", "allow_leaks: exempt a test from the conftest leak check")
    _install_spawn_recorders()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _STARTED.clear()  # before any fixture: a module fixture that spawns counts for this test


# -- the leak check --------------------------------------------------------------------------------
def _proc_stat(pid: str):
    """(state, ppid) of a process from /proc, None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            tail = f.read().rsplit(b")", 1)[1].split()
        return tail[0].decode(), int(tail[1])
    except (OSError, IndexError, ValueError):
        return None


def _session_processes() -> dict:
    """{pid: command line} of live (not zombie) processes started from this session: the
    descendants of this process, and every process carrying this session's variable."""
    me = os.getpid()
    marker = f"{SESSION_VAR}={SESSION}".encode()
    stats, found = {}, set()
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:  # no /proc (not Linux): nothing to check with
        return {}
    for pid in pids:
        st = _proc_stat(pid)
        if st is None or st[0] in ("Z", "X"):
            continue
        stats[int(pid)] = st[1]
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if marker in f.read().split(b"\0"):
                    found.add(int(pid))
        except OSError:
            pass
    for pid in stats:  # descendants (forked children do not show later os.environ changes)
        seen, p = set(), pid
        while p in stats and p not in seen and p > 1:
            seen.add(p)
            p = stats[p]
            if p == me:
                found.add(pid)
                break
    found.discard(me)
    out = {}
    for pid in sorted(found):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        if not any(helper in cmd for helper in _MP_HELPERS):
            out[pid] = cmd[:200]
    return out


def _leaked_processes() -> list:
    deadline = time.monotonic() + PROCESS_GRACE_S
    alive = _session_processes()
    while alive and time.monotonic() < deadline:  # e.g. a launcher still reaping its workers
        time.sleep(0.1)
        alive = _session_processes()
    for pid in alive:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return [f"process {pid} still alive {PROCESS_GRACE_S:.0f}s after the test (killed now): {cmd}"
            for pid, cmd in alive.items()]


def _registry_entries(grid) -> dict:
    """nnscaler's process groups cached in this process, by registry name: every `_GROUPS`
    entry, and the `_GRIDS` entries that hold a group (a grid of one process without
    torch.distributed holds none and is only a cached layout)."""
    if not (hasattr(grid, "_GROUPS") and hasattr(grid, "_GRIDS")):
        raise AssertionError("nnscaler.runtime.grid has no _GRIDS/_GROUPS registry any more: update "
                             "tests/conftest.py:_registry_entries to the registry it keeps now")
    grids = {k: g for k, g in dict(grid._GRIDS).items()
             if getattr(g, "sync_group", None) is not None or getattr(g, "unit_group", None) is not None}
    return {"_GROUPS": dict(grid._GROUPS), "_GRIDS": grids}


def _leaked_groups() -> list:
    problems = []
    grid = sys.modules.get("nnscaler.runtime.grid")
    if grid is not None:
        entries = {n: e for n, e in _registry_entries(grid).items() if e}
        if entries:
            problems.append("nnscaler's group registry is not empty (destroyed now): "
                            + "; ".join(f"{n}: {sorted(map(str, e))}" for n, e in entries.items()))
            grid.RankGrid.destroy_all()
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        problems.append("a torch.distributed default process group is still initialised in the pytest "
                        "process (destroyed now)")
        if grid is not None:
            grid.RankGrid.destroy_all()
        dist.destroy_process_group()
    return problems


def _file_roots() -> list:
    roots = [ROOT]
    cwd = Path.cwd().resolve()
    if ROOT not in (cwd, *cwd.parents):
        roots.append(cwd)
    return roots


def _hand_written(path: str) -> bool:
    """Files people add while a test runs (this repository is edited during test runs): sources
    and docs in the source, test, doc, example, bench and tool trees. Generated code
    (gencode*.py) is never taken for one."""
    rel = os.path.relpath(path, ROOT).replace(os.sep, "/")
    name = rel.rsplit("/", 1)[-1]
    if (rel.startswith("packages/") and "/src/" in rel) or rel.startswith("bench/results/"):
        return True  # sources; benchmark figures, recorded by people running the benchmarks
    if rel.startswith("runs/"):
        return True  # what the README's examples write (./runs/<example>/), run beside the tests
    return (rel.split("/", 1)[0] in _SOURCE_TREES and name.endswith(_SOURCE_SUFFIXES)
            and not name.startswith("gencode"))


def _tree(skip: set) -> set:
    """Every file under the repository (and under the working directory when outside it),
    without VCS and cache directories and without the pytest temporary directory."""
    paths = set()
    for root in _file_roots():
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames
                           if d not in _SKIP_DIRS and os.path.join(dirpath, d) not in skip]
            paths.update(os.path.join(dirpath, n) for n in filenames if not n.endswith((".pyc", ".pyo")))
    return paths


@pytest.fixture(autouse=True)
def _leak_check(request, tmp_path_factory):
    """The leak check described at the top of this file; set up first and torn down last of
    the test's function-scoped fixtures."""
    basetemp = str(tmp_path_factory.getbasetemp().resolve())
    skip = {basetemp}
    if request.config.getoption("--update-golden"):
        skip.add(str(ROOT / "tests" / "golden"))  # asked for: the golden files are rewritten
    before = _tree(skip)
    yield
    problems = []
    spawned = sorted({f"{kind}: {what}" for kind, what in _STARTED})
    if spawned and request.node.get_closest_marker("multiprocess") is None:
        problems.append("the test started processes but is not marked @pytest.mark.multiprocess (the "
                        "fast tier must not start any; mark the test or its module):\n    "
                        + "\n    ".join(spawned[:5]))
    if request.node.get_closest_marker("allow_leaks") is None:
        if spawned or request.node.get_closest_marker("multiprocess") is not None:
            problems += _leaked_processes()
        problems += _leaked_groups()
        new = sorted(p for p in _tree(skip) - before if not _hand_written(p))
        if new:
            problems.append("files appeared outside tmp_path (write them under tmp_path):\n    "
                            + "\n    ".join(os.path.relpath(p, ROOT) for p in new[:20]))
    if problems:
        pytest.fail("leak check: " + "\n".join(problems), pytrace=False)
