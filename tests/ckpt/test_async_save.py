"""async_save: returns once the state is copied into the reused shared buffer; the background
process writes, hashes and commits; the handle's wait() returns once committed or raises the
background error (every call); the checkpoint holds the state at the call; the next save waits for
the one in flight; bad arguments are refused before anything is written; a dead worker is reported
and replaced. Two gloo ranks saving together (and killed while they do) are test_save_crash.py's.
Every test starts this process's background save process, so all are marked multiprocess; each
stops it at its end."""
from __future__ import annotations

import os
import shutil
import signal
import time

import pytest
import torch

from fake_modules import FakeParallel, trained
from nnscaler.ckpt import AsyncSave, CheckpointError, async_save, load, save, stop_async_saves, verify
from nnscaler.ckpt import prepare_async_save as ckpt_prepare
from nnscaler.ckpt.async_save import _SAVER, AsyncSaveWarning
from nnscaler.ckpt.inflight import in_flight

pytestmark = pytest.mark.multiprocess


@pytest.fixture(autouse=True)
def _stop_worker():
    yield
    stop_async_saves()  # no process left behind


def _state(pm):
    return {k: v.clone() for k, v in pm.state_dict().items()}


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _staging(root):
    return [p for p in root.iterdir() if ".writing-" in p.name and p.is_dir()]


def test_handle_and_the_state_at_the_call(tmp_path):
    pm, opt = trained()
    at_call = _state(pm)
    h = async_save(tmp_path / "ck", pm, opt, extra={"step": 2, "t": torch.arange(3)}, files={"cfg.yaml": "a: 1\n"})
    assert isinstance(h, AsyncSave) and h.path == tmp_path / "ck"
    child = os.fork()  # a forked child (a data loader's worker) owns no background process, no save in flight
    if child == 0:
        os._exit(0 if _SAVER.proc is None and _SAVER.buffer is None and in_flight() is None else 1)
    assert os.waitpid(child, 0)[1] == 0 and _SAVER.proc is not None and in_flight() is h
    with torch.no_grad():  # training goes on at once
        for p in pm.parameters():
            p.add_(1.0)
    assert h.wait() == tmp_path / "ck" and h.done() and h.wait() == tmp_path / "ck"
    assert set(verify(tmp_path / "ck").files) == {"rank-00000-of-00001.safetensors", "cfg.yaml"}
    pm2, opt2 = trained(seed=7, steps=1)
    extra = load(tmp_path / "ck", pm2, opt2)
    assert extra["step"] == 2 and torch.equal(extra["t"], torch.arange(3))
    assert _same(_state(pm2), at_call) and not _same(_state(pm2), _state(pm))
    assert os.listdir(tmp_path) == ["ck"]  # no marker, staging or outcome file left


def test_buffer_and_worker_are_reused_and_the_next_save_waits(tmp_path):
    pm, opt = trained()
    async_save(tmp_path / "a", pm, opt).wait()
    made, pid, ptr = _SAVER.buffers_made, _SAVER.proc.pid, _SAVER.buffer.data_ptr()
    first = async_save(tmp_path / "b", pm, opt)
    second = async_save(tmp_path / "c", pm, opt)  # waits for the first
    assert first.done()
    assert (tmp_path / "b" / "manifest.json").is_file()
    second.wait()
    assert (_SAVER.buffers_made, _SAVER.proc.pid, _SAVER.buffer.data_ptr()) == (made, pid, ptr)
    third = async_save(tmp_path / "d", pm, opt)
    save(tmp_path / "e", pm, opt)  # the synchronous save waits too
    assert third.done() and verify(tmp_path / "d") and verify(tmp_path / "e")
    big, opt_big = trained(dim=64)  # a larger state: a larger buffer (and a new worker mapping it)
    async_save(tmp_path / "f", big, opt_big).wait()
    assert _SAVER.buffers_made == made + 1
    pm2 = FakeParallel(seed=3, dim=64)
    load(tmp_path / "f", pm2)
    assert _same(_state(pm2), _state(big))


def test_wait_reraises_the_background_error_and_the_previous_checkpoint_stays(tmp_path):
    pm, opt = trained()
    save(tmp_path / "ck", pm, opt, extra={"v": 1})
    before = (tmp_path / "ck" / "manifest.json").read_bytes()
    stop_async_saves()  # the next worker takes a moment to start: time to pull its directory away
    h = async_save(tmp_path / "ck", FakeParallel(seed=4), overwrite=True)
    (staging,) = _staging(tmp_path)
    shutil.rmtree(staging)
    for _ in range(2):
        with pytest.raises(CheckpointError, match=r"rank 0 could not write .*previous checkpoint is intact"):
            h.wait()
    assert (tmp_path / "ck" / "manifest.json").read_bytes() == before and load(tmp_path / "ck", FakeParallel()) == \
        {"v": 1}
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def test_a_dead_worker_is_reported_warned_about_and_replaced(tmp_path):
    pm, opt = trained()
    h = async_save(tmp_path / "b", pm, opt)
    os.kill(_SAVER.proc.pid, signal.SIGKILL)
    with pytest.raises(CheckpointError, match=r"background save process of this rank exited .*previous checkpoint "
                                              r"is intact"):
        h.wait()
    assert not (tmp_path / "b").exists()
    h = async_save(tmp_path / "c", pm, opt)
    os.kill(_SAVER.proc.pid, signal.SIGKILL)
    while not h.done():
        time.sleep(0.01)
    with pytest.warns(AsyncSaveWarning, match=r"asynchronous save to .*c failed"):  # nobody waited for it
        async_save(tmp_path / "b", pm, opt).wait()  # a new worker
    assert verify(tmp_path / "b")


@pytest.mark.parametrize("kwargs, match", [
    ({"kind": "merged"}, r"kind must be 'sharded' or 'deduped'"),
    ({"extra": {"x": object()}}, r"'x' is a object, not a JSON value"),
    ({"files": {"a/b": "x"}}, r"is not a usable file name"),
])
def test_bad_arguments_are_refused_before_anything_is_written(tmp_path, kwargs, match):
    pm, opt = trained()
    with pytest.raises(CheckpointError, match=match):
        async_save(tmp_path / "ck", pm, opt, **kwargs)
    assert list(tmp_path.iterdir()) == []



def _unprepared():
    """This process as if it had never saved: no background process, no buffer."""
    stop_async_saves(release=True)
    assert _SAVER.proc is None and _SAVER.buffer is None


def _file_parts(path):
    """(the safetensors header without this save's tag, the tensor bytes) of a rank file."""
    import json
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    header["__metadata__"].pop("nnscaler_save", None)
    return header, data[8 + n:]


def _manifest(path):
    import json
    m = json.loads((path / "manifest.json").read_text())
    for k in ("created", "files"):
        m.pop(k)
    return m


def test_prepare_starts_the_writer_before_the_first_save(tmp_path, monkeypatch):
    """prepare_async_save (before the optimizer's first step: Adam holds no state yet) makes the
    buffer, touched, large enough for the save after that step, and starts the process; calling it
    again sizes nothing; the first async_save then neither makes a buffer nor starts a process; the
    checkpoint is byte for byte the one written without preparing (but for the save's tag in the
    rank file's header) and holds the same tensors as `save`'s."""
    import subprocess
    import sys
    module = sys.modules["nnscaler.ckpt.async_save"]
    _unprepared()
    with pytest.raises(CheckpointError, match=r"Linear is not a parallelized module and holds none: pass the module "
                                              r"nnscaler.parallelize returned"):
        ckpt_prepare(torch.nn.Linear(2, 2))
    assert _SAVER.proc is None and _SAVER.buffer is None
    pm = FakeParallel(dim=512)  # Adam's moments (2 MiB) outgrow the buffer's headroom (1 MiB)
    opt = torch.optim.Adam(pm.parameters(), lr=0.1)
    before = _SAVER.buffers_made
    size = ckpt_prepare(pm, opt)
    made, proc = _SAVER.buffers_made, _SAVER.proc
    assert made == before + 1 and proc is not None and proc.poll() is None and size == _SAVER.buffer.numel()

    def refused(*args, **kwargs):
        raise AssertionError("not expected now")
    with monkeypatch.context() as m:
        m.setattr(module, "collect", refused)  # a later call sizes nothing ...
        assert ckpt_prepare(pm, opt) == size and _SAVER.proc is proc
    opt.zero_grad()
    pm(torch.randint(0, 6, (5,), generator=torch.Generator().manual_seed(0))).backward()
    opt.step()  # Adam's state appears
    with monkeypatch.context() as m:
        m.setattr(subprocess, "Popen", refused)  # ... and the first save starts no process
        async_save(tmp_path / "prepared", pm, opt, extra={"step": 1}).wait()
    assert (_SAVER.buffers_made, _SAVER.proc) == (made, proc)
    stop_async_saves()
    assert ckpt_prepare(pm, opt) == size and _SAVER.proc is not proc and _SAVER.buffers_made == made  # restarted
    _unprepared()
    async_save(tmp_path / "unprepared", pm, opt, extra={"step": 1}).wait()
    save(tmp_path / "sync", pm, opt, extra={"step": 1})
    name = "rank-00000-of-00001.safetensors"
    prepared, unprepared = _file_parts(tmp_path / "prepared" / name), _file_parts(tmp_path / "unprepared" / name)
    assert prepared == unprepared and prepared[1] == _file_parts(tmp_path / "sync" / name)[1]
    assert _manifest(tmp_path / "prepared") == _manifest(tmp_path / "unprepared") == _manifest(tmp_path / "sync")
