"""What ``nnscaler train --nproc N`` sets for its workers (trainer/cli/worker_env.py): threads and
glibc's malloc thresholds, never over what the user set; and a worker started by the launcher
(torch's agent, as `nnscaler train` starts it) has glibc's threshold in effect (100 KB mallocs are
mappings of their own; under glibc's default 128 KiB threshold they come from the heap)."""
from __future__ import annotations

import json
import os

import pytest

from nnscaler.trainer.cli.worker_env import MALLOC_ENV, OPT_OUT, worker_env

MALLOC = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def test_sets_threads_and_malloc_thresholds():
    env = {}
    added = worker_env(2, env)
    assert env == added == {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // 2)), **MALLOC_ENV}
    assert MALLOC_ENV == {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "131072"}


@pytest.mark.parametrize("user", [{"MALLOC_MMAP_THRESHOLD_": "262144"}, {"MALLOC_TRIM_THRESHOLD_": "0"},
                                  {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=4096"}, {OPT_OUT: "1"}])
def test_what_the_user_set_leaves_malloc_alone(user):
    env = dict(user, OMP_NUM_THREADS="3")
    assert worker_env(4, env) == {}
    assert env == dict(user, OMP_NUM_THREADS="3")


def test_unrelated_tunables_and_a_disabled_opt_out_do_not_count():
    for user in ({"GLIBC_TUNABLES": "glibc.pthread.rseq=0"}, {OPT_OUT: "0"}):
        env = dict(user)
        assert worker_env(1, env) == {"OMP_NUM_THREADS": str(os.cpu_count() or 1), **MALLOC_ENV}


PROBE = '''
import ctypes, json, os, sys

class Info(ctypes.Structure):  # glibc's struct mallinfo2
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                  "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
libc.malloc.restype = ctypes.c_void_p
# glibc serves a request from the heap's free top chunk when it fits, whatever the threshold, and the
# top may hold up to the trim threshold (128 KiB): one 100 KB block may come from there, never eight.
before = libc.mallinfo2().hblks
blocks = [libc.malloc(100_000) for _ in range(8)]
mapped = libc.mallinfo2().hblks - before
for p in blocks:
    libc.free(ctypes.c_void_p(p))
with open(os.path.join(sys.argv[1], "rank" + os.environ["RANK"] + ".json"), "w") as f:
    json.dump({"env": {k: os.environ.get(k) for k in KEYS}, "mapped": mapped}, f)
'''.replace("KEYS", repr(MALLOC + ("OMP_NUM_THREADS",)))


@pytest.fixture
def clean_environ():
    saved = dict(os.environ)
    for k in (*MALLOC, OPT_OUT, "GLIBC_TUNABLES", "OMP_NUM_THREADS"):
        os.environ.pop(k, None)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.mark.multiprocess
def test_a_launched_worker_has_the_threshold_in_effect(tmp_path, clean_environ):
    import importlib
    cli_main = importlib.import_module("nnscaler.trainer.cli.main")
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    assert cli_main._launch(2, [str(tmp_path)], entry=(str(probe),)) == 0
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen["env"] == {**MALLOC_ENV, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // 2))}
        assert seen["mapped"] >= 6, seen  # 100 KB > 64 KiB: mappings of their own (0 under glibc's default)
