"""Run by test_merge_crash.py in a fresh interpreter: SIGKILL a ``merge(..., overwrite=True)`` over
an earlier merge at every one of its file events and check after each crash that the destination
is the previous merge or the new one, whole.

A forked child merges checkpoint B over the merge of checkpoint A and SIGKILLs itself at its N-th
file event (a write, an fsync, a mkdir, a rename, the directory exchange, a tree removal, a
kernel copy). ``exchange`` = 0 makes the exchange unavailable (the two-rename fallback): then a
crash between the renames may leave no destination, with the previous merge whole in its
staging-named sibling, which is renamed back as the read error says. Prints a JSON report."""
from __future__ import annotations

import json
import os
import shutil
import signal
import sys

import torch
from safetensors.torch import load_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from crash_events import FileEvents  # noqa: E402
from fake_modules import trained  # noqa: E402

import nnscaler.ckpt as ckpt  # noqa: E402
from nnscaler.ckpt import commit, safetensors_file  # noqa: E402

_TARGETS = ((os, "fsync"), (os, "rename"), (os, "replace"), (os, "mkdir"), (os, "copy_file_range"),
            (commit, "exchange_paths"), (shutil, "rmtree"), (safetensors_file.SafetensorsWriter, "_emit"))


def merge_in_child(src, dst, kill_at, exchange):
    """Fork a child that merges `src` over `dst`; returns (exit status, events it saw)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            if not exchange:
                commit.exchange_paths = lambda a, b: False
            events = FileEvents(kill_at, _TARGETS)
            ckpt.merge(src, dst, overwrite=True)
            os.write(w, str(events.count).encode())
            os._exit(0)
        finally:
            os._exit(1)
    os.close(w)
    status = os.waitpid(pid, 0)[1]
    with os.fdopen(r) as f:
        seen = f.read()
    return status, int(seen) if seen else None


def _which(path, expected):
    """'A' or 'B': which checkpoint the merge at `path` holds (verified whole), else None."""
    ckpt.verify(path)
    weights = load_file(os.path.join(path, "model.safetensors"))
    for name, tensors in expected.items():
        if all(torch.equal(weights[k], v) for k, v in tensors.items()):
            return name
    return None


def main(root, exchange):
    torch.set_num_threads(1)
    expected = {}
    for name, seed in (("A", 1), ("B", 2)):
        pm, opt = trained(seed=seed)
        ckpt.save(os.path.join(root, name), pm, opt, extra={"seed": seed})
        expected[name] = {"fc.weight": pm.fc_weight.detach(), "emb.weight": pm.emb_weight.detach()}
    dst = os.path.join(root, "merged")
    ckpt.merge(os.path.join(root, "A"), dst)
    status, events = merge_in_child(os.path.join(root, "B"), dst, 0, exchange)
    assert status == 0 and _which(dst, expected) == "B", status
    results = []
    for kill_at in range(1, events + 1):
        ckpt.merge(os.path.join(root, "A"), dst, overwrite=True)  # the previous merge, in this process
        status, _ = merge_in_child(os.path.join(root, "B"), dst, kill_at, exchange)
        killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        leftovers = sorted(n for n in os.listdir(root) if n not in ("A", "B", "merged"))
        restored = False
        if not os.path.exists(dst):  # between the fallback's two renames: the previous merge is aside
            hint = ""
            try:
                ckpt.verify(dst)
            except ckpt.CheckpointError as e:
                hint = str(e)
            aside = [n for n in leftovers if n in hint and "rename it to merged" in hint]
            os.rename(os.path.join(root, aside[0]), dst)
            leftovers.remove(aside[0])
            restored = True
        found = _which(dst, expected)
        for n in leftovers:  # a crashed merge's staging directory: never taken for a checkpoint
            try:
                ckpt.verify(os.path.join(root, n))
                found = None
            except ckpt.CheckpointError:
                pass
            shutil.rmtree(os.path.join(root, n))
        results.append({"point": kill_at, "killed": killed, "found": found, "restored": restored,
                        "leftovers": len(leftovers)})
    print(json.dumps({"events": events, "results": results}))


if __name__ == "__main__":
    main(sys.argv[1], bool(int(sys.argv[2])))
