"""A test-only hook (``hook.type: fault_hooks.Faults``) that injures a run at given points, and a
dataset that records the indices it reads (importable by torchrun's workers via PYTHONPATH).

``Faults(kills=[[attempt, where, step, rank], ...], term_at=[step, rank], marker=[step, dir])``:

- ``kills``: in restart number `attempt` (``TORCHELASTIC_RESTART_COUNT``), rank `rank` SIGKILLs
  itself at `where`: ``step_start`` (before the forward of step `step`), ``step_end`` (after its
  optimizer step, before its checkpoint), ``in_save`` (inside nnscaler.ckpt's commit of the
  checkpoint of step `step`: every file written, the manifest not; rank 0 commits).
- ``term_at``: rank `rank` sends itself SIGTERM at the end of step `step` (a preemption that
  reached one worker only).
- ``marker``: rank 0 writes ``<dir>/step`` at the end of step `step` and waits (up to 60 s) until
  its SIGTERM handler (the Trainer's `PreemptionWatch`) has recorded a signal: the test signals
  the launcher once the file exists, and the step ends only once the signal got through.
- ``index_log``: each rank appends the sample indices of every training step to
  ``<index_log>/rank<RANK>`` (the batches of `IndexDataset` carry them).
"""
from __future__ import annotations

import os
import signal
import time


def _attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class Faults:
    def __init__(self, kills=(), term_at=None, marker=None, index_log=None):
        self.index_log = index_log
        self.kills = [(int(a), w, int(s), int(r)) for a, w, s, r in kills]
        self.term_at = term_at
        self.marker = marker
        self._armed = False
        if self._mine("in_save"):
            from nnscaler.ckpt.commit import StagingDir
            commit = StagingDir.commit
            hook = self

            def dying_commit(staging, *args, **kwargs):
                if hook._armed:
                    _die()
                return commit(staging, *args, **kwargs)
            StagingDir.commit = dying_commit

    def _mine(self, where, step=None) -> bool:
        return any(a == _attempt() and w == where and r == _rank() and (step is None or s == step)
                   for a, w, s, r in self.kills)

    def on_train_step_start(self, trainer, batches):
        if self.index_log is not None:
            with open(os.path.join(self.index_log, f"rank{_rank()}"), "a") as f:
                f.writelines(f"{int(i)}\n" for b in batches for i in b["idx"])
        if self._mine("step_start", trainer.state.step + 1):
            _die()

    def on_step_end(self, trainer, epoch, idx, step_metrics, aggregated_outputs):
        step = trainer.state.step
        if self._mine("step_end", step):
            _die()
        if self.term_at is not None and step == int(self.term_at[0]) and _rank() == int(self.term_at[1]):
            os.kill(os.getpid(), signal.SIGTERM)
        if self.marker is not None and step == int(self.marker[0]) and _rank() == 0:
            folder = self.marker[1]
            with open(os.path.join(folder, "step"), "w") as f:
                f.write(str(step))
            watch = getattr(signal.getsignal(signal.SIGTERM), "__self__", None)
            deadline = time.monotonic() + 60
            while watch is not None and watch.received is None and time.monotonic() < deadline:
                time.sleep(0.05)

    def on_save_checkpoint(self, trainer, checkpoint):
        self._armed = self._mine("in_save", trainer.state.step)


class IndexDataset:
    """`trainer_models.RandomDataset` whose samples also carry their index (``idx``; the model
    ignores it)."""

    def __init__(self, size: int = 32):
        from trainer_models import RandomDataset
        self.data = RandomDataset(size=size)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        import torch
        return dict(self.data[i], idx=torch.tensor(i))
