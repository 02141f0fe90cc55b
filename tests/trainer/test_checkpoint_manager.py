"""CheckpointManager (nnscaler.trainer.checkpoints): the one "best" rule, what a save records and
where last / best point, the typed resume result, the schedule; on a stand-in for nnscaler.ckpt
(one process, no model save)."""
from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch

from nnscaler.trainer import CheckpointConfig
from nnscaler.trainer.checkpoints import CheckpointManager, Resumed, TRAINER_KEY, is_better, layout
from nnscaler.trainer.errors import TrainerConfigWarning
from nnscaler.trainer.state import TrainState


class FakeCkpt:
    """nnscaler.ckpt's save / load / inspect / merge: a directory with the extra as its manifest."""

    def __init__(self, world_size=1, extra=None):
        self.world_size, self.extra, self.saves = world_size, extra, []

    def save(self, path, model, optimizer, kind, extra, files):
        os.makedirs(path)
        with open(os.path.join(path, "manifest.json"), "w") as f:
            json.dump({"ranks": [{"extra": extra}]}, f)
        self.saves.append(path)

    def load(self, path, model, optimizer):
        return self.extra

    def inspect(self, path):
        return {"world_size": self.world_size, "rng_ranks": [0]}

    def merge(self, src, dst):
        raise AssertionError("not used")


class Hooks:
    def __init__(self):
        self.saved = []

    def on_save_checkpoint(self, trainer, checkpoint):
        checkpoint["mine"] = {"step": trainer.state.step}
        self.saved.append(checkpoint)


class Precision:
    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        self.loaded = state


def fake_trainer(val_losses=(), train_loss=1.0, lr_scheduler=None, scheduler_args=None):
    """The Trainer's public face the manager uses; `validate` returns the next of `val_losses`."""
    losses = iter(val_losses)
    trainer = SimpleNamespace(state=TrainState(last_train_loss=train_loss), hooks=Hooks(), model=torch.nn.Linear(2, 2),
                              optimizer=None, lr_scheduler=lr_scheduler, precision=Precision(), world_size=1, rank=0,
                              train_args=SimpleNamespace(lr_scheduler=SimpleNamespace(args=scheduler_args or {}),
                                                         resolved_global_batch_size=8))
    trainer.validate = lambda: next(losses, None)
    return trainer


@pytest.fixture
def fake_ckpt(monkeypatch):
    fake = FakeCkpt()
    monkeypatch.setattr(layout, "BACKEND", fake)
    return fake


def test_is_better_is_the_one_rule():
    assert is_better(1.0, None)  # the first loss is the best
    assert is_better(0.5, 1.0) and not is_better(1.5, 1.0)  # the lowest wins
    assert is_better(1.0, 1.0)  # a tie goes to the newer checkpoint
    assert not is_better(None, 1.0) and not is_better(None, None)  # no loss never wins


def save_at(manager, trainer, step, val_loss=None):
    trainer.state.step, trainer.state.epoch = step, 0
    saved = manager.save(trainer, val_loss)
    if saved is not None:
        trainer.state.best_val_loss = saved.best_val_loss  # as Trainer.save_checkpoint does
    return saved


def test_save_moves_best_only_when_better_and_records_it(tmp_path, fake_ckpt):
    manager = CheckpointManager(CheckpointConfig(save_dir=str(tmp_path)))
    trainer = fake_trainer(val_losses=[2.0, 1.0, 3.0, 1.0])
    got = [save_at(manager, trainer, step) for step in (1, 2, 3, 4)]
    assert [s.val_loss for s in got] == [2.0, 1.0, 3.0, 1.0]  # validation ran for each save
    assert [s.best_val_loss for s in got] == [2.0, 1.0, 1.0, 1.0]
    assert os.readlink(tmp_path / "last") == "0000-0004"
    assert os.readlink(tmp_path / "best") == "0000-0004"  # the tie at step 4 took it from step 2
    records = [h[TRAINER_KEY]["state"] for h in trainer.hooks.saved]
    assert [(r["last_val_loss"], r["best_val_loss"]) for r in records] == [(2.0, 2.0), (1.0, 1.0), (3.0, 1.0),
                                                                          (1.0, 1.0)]
    assert trainer.hooks.saved[0]["mine"] == {"step": 1}  # on_save_checkpoint adds to the saved extra
    with open(tmp_path / "0000-0003" / "manifest.json") as f:
        assert json.load(f)["ranks"][0]["extra"]["mine"] == {"step": 3}


def test_without_validation_the_train_loss_ranks_and_a_given_loss_skips_validation(tmp_path, fake_ckpt):
    manager = CheckpointManager(CheckpointConfig(save_dir=str(tmp_path)))
    trainer = fake_trainer(val_losses=[], train_loss=0.7)
    assert save_at(manager, trainer, 1).val_loss == 0.7
    trainer = fake_trainer(val_losses=[9.0])
    assert save_at(manager, trainer, 2, val_loss=0.1).val_loss == 0.1
    assert save_at(manager, trainer, 2) is None  # this step is saved: nothing written, nothing validated
    assert fake_ckpt.saves == [str(tmp_path / "0000-0001"), str(tmp_path / "0000-0002")]


def test_keep_last_n_never_deletes_what_best_points_to(tmp_path, fake_ckpt):
    manager = CheckpointManager(CheckpointConfig(save_dir=str(tmp_path), keep_last_n_checkpoints=1))
    trainer = fake_trainer(val_losses=[1.0, 2.0, 3.0])
    for step in (1, 2, 3):
        save_at(manager, trainer, step)
    assert sorted(n for n in os.listdir(tmp_path) if n[0].isdigit()) == ["0000-0001", "0000-0003"]


class FakeHandle:
    """An AsyncSave stand-in: its staging directory becomes the checkpoint at `wait()` (the
    commit), or `wait()` raises `error`."""

    def __init__(self, staging, path, log, error=None):
        self.staging, self.path, self.log, self.error = staging, path, log, error

    def wait(self):
        self.log.append(("wait", os.path.basename(self.path)))
        if self.error:
            import shutil
            shutil.rmtree(self.staging)
            from nnscaler.ckpt import CheckpointError
            raise CheckpointError(self.error)
        if os.path.exists(self.staging):
            os.rename(self.staging, self.path)
        return self.path


class FakeAsyncCkpt(FakeCkpt):
    """FakeCkpt with `async_save`: writes into nnscaler.ckpt's staging name and commits on wait()."""

    def __init__(self):
        super().__init__()
        self.log, self.fail = [], None

    def prepare_async_save(self, model, optimizer):
        self.log.append(("prepare", type(optimizer).__name__))

    def async_save(self, path, model, optimizer, kind, extra, files):
        from nnscaler.ckpt.names import staging_prefix
        staging = os.path.join(os.path.dirname(path), staging_prefix(os.path.basename(path)) + "0a1b")
        self.save(staging, model, optimizer, kind, extra, files)
        self.log.append(("async_save", os.path.basename(path)))
        return FakeHandle(staging, path, self.log, self.fail)


def numbered(tmp_path):
    return sorted(n for n in os.listdir(tmp_path) if n[0].isdigit())


def test_async_save_moves_last_best_and_prunes_only_once_committed(tmp_path, monkeypatch):
    fake = FakeAsyncCkpt()
    monkeypatch.setattr(layout, "BACKEND", fake)
    manager = CheckpointManager(CheckpointConfig(save_dir=str(tmp_path), keep_last_n_checkpoints=1, async_save=True))
    trainer = fake_trainer(val_losses=[2.0, 3.0, 1.0])
    assert save_at(manager, trainer, 1).path == str(tmp_path / "0000-0001")
    assert manager.pending.step == 1 and manager.pending.val_loss == 2.0 and manager.pending.best
    assert numbered(tmp_path) == [] and not os.path.lexists(tmp_path / "last")  # not committed: invisible
    assert layout.resolve_resume("auto", str(tmp_path)) is None  # auto never picks the staging directory
    save_at(manager, trainer, 2)  # waits for step 1's commit first, then finishes its bookkeeping
    assert fake.log == [("async_save", "0000-0001"), ("wait", "0000-0001"), ("async_save", "0000-0002")]
    assert os.readlink(tmp_path / "last") == os.readlink(tmp_path / "best") == "0000-0001"
    assert numbered(tmp_path) == ["0000-0001"] and layout.resolve_resume("auto", str(tmp_path)).endswith("0000-0001")
    save_at(manager, trainer, 3)  # step 2 (loss 3.0) commits: last moves, best stays, both kept (best + newest)
    assert os.readlink(tmp_path / "last") == "0000-0002" and os.readlink(tmp_path / "best") == "0000-0001"
    assert numbered(tmp_path) == ["0000-0001", "0000-0002"]
    manager.close()  # step 3 (loss 1.0) commits: last and best move to it, keep_last_n prunes the rest
    assert manager.pending is None and fake.log[-1] == ("wait", "0000-0003")
    assert os.readlink(tmp_path / "last") == os.readlink(tmp_path / "best") == "0000-0003"
    assert numbered(tmp_path) == ["0000-0003"]
    manager.close()  # nothing in flight: nothing waited
    assert fake.log.count(("wait", "0000-0003")) == 1


def test_a_failed_async_save_moves_nothing(tmp_path, monkeypatch):
    from nnscaler.ckpt import CheckpointError
    from nnscaler.ckpt import AsyncSaveWarning
    fake = FakeAsyncCkpt()
    monkeypatch.setattr(layout, "BACKEND", fake)
    manager = CheckpointManager(CheckpointConfig(save_dir=str(tmp_path), async_save=True))
    trainer = fake_trainer(val_losses=[2.0, 1.0, 0.5])
    save_at(manager, trainer, 1)
    fake.fail = "rank 1 could not write (disk full)"
    save_at(manager, trainer, 2)
    with pytest.raises(CheckpointError, match="disk full"):
        manager.wait()  # the error reaches the run; last stays on the committed step 1
    assert os.readlink(tmp_path / "last") == os.readlink(tmp_path / "best") == "0000-0001"
    save_at(manager, trainer, 3)
    with pytest.warns(AsyncSaveWarning, match="0000-0003 was not committed .*disk full"):
        manager.close(failed=True)  # a failing run: warned, not raised (the run's own error propagates)
    assert numbered(tmp_path) == ["0000-0001"] and os.readlink(tmp_path / "last") == "0000-0001"
    fake.fail = None
    save_at(manager, trainer, 4, val_loss=0.1)
    manager.close(failed=True)  # committed all the same: last / best move on a failing run too
    assert os.readlink(tmp_path / "last") == os.readlink(tmp_path / "best") == "0000-0004"


def test_async_save_needs_a_backend_that_has_it(tmp_path, fake_ckpt):
    from nnscaler.trainer.errors import TrainerError
    manager = CheckpointManager(CheckpointConfig(save_dir=str(tmp_path), async_save=True))
    with pytest.raises(TrainerError, match="checkpoint.async_save: the installed nnscaler-ckpt has no async_save"):
        save_at(manager, fake_trainer(), 1)


def test_prepare_starts_the_writer_only_for_async_saves(tmp_path, monkeypatch):
    """At set-up the manager has nnscaler.ckpt make the background writer and its buffer when
    checkpoint.async_save is on (and the run saves); a backend without prepare_async_save is
    refused naming the setting."""
    from nnscaler.trainer.errors import TrainerError
    fake = FakeAsyncCkpt()
    monkeypatch.setattr(layout, "BACKEND", fake)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    for async_save, no_save in ((False, False), (True, True)):
        CheckpointManager(CheckpointConfig(save_dir=str(tmp_path), async_save=async_save, no_save=no_save)).prepare(
            None, opt)
    assert fake.log == []
    CheckpointManager(CheckpointConfig(save_dir=str(tmp_path), async_save=True)).prepare(None, opt)
    assert fake.log == [("prepare", "SGD")]
    monkeypatch.setattr(layout, "BACKEND", FakeCkpt())
    with pytest.raises(TrainerError, match=r"checkpoint.async_save: the installed nnscaler-ckpt has no "
                                           r"prepare_async_save\(\); set checkpoint.async_save: false"):
        CheckpointManager(CheckpointConfig(save_dir=str(tmp_path), async_save=True)).prepare(None, opt)


def test_the_schedule():
    manager = CheckpointManager(CheckpointConfig(every_n_train_steps=2, every_n_epochs=3))
    assert [s for s in range(1, 7) if manager.due_after_step(s)] == [2, 4, 6]
    assert [e for e in range(1, 7) if manager.due_after_epoch(e)] == [3, 6]
    assert manager.due_at_end(5) and not manager.due_at_end(0)
    off = CheckpointManager(CheckpointConfig(no_save=True, every_n_train_steps=2, every_n_epochs=1))
    assert not any(off.due_after_step(s) or off.due_after_epoch(s) or off.due_at_end(s) for s in range(1, 5))


def record(step=6, epoch=1, idx=2, world_size=1, lr_scheduler=None):
    state = TrainState(epoch=epoch, idx_in_epoch=idx, samples_in_epoch=idx * 8, step=step, best_val_loss=0.5).to_dict()
    return {TRAINER_KEY: {"state": state, "world_size": world_size, "lr_scheduler": lr_scheduler, "precision": None},
            "mine": 1}


def test_resume_returns_what_the_trainer_applies_and_writes_nothing_into_it(tmp_path, fake_ckpt):
    (tmp_path / "0001-0006").mkdir()
    os.symlink("0001-0006", tmp_path / "last")
    fake_ckpt.extra = record()
    manager = CheckpointManager(CheckpointConfig(save_dir=str(tmp_path), resume_from="last"))
    trainer = fake_trainer()
    fresh = trainer.state
    resumed = manager.resume(trainer)
    assert isinstance(resumed, Resumed)
    assert resumed.path == os.path.realpath(tmp_path / "0001-0006")
    assert resumed.state == TrainState(epoch=1, idx_in_epoch=2, samples_in_epoch=16, step=6, best_val_loss=0.5)
    assert resumed.extra["mine"] == 1 and resumed.rng is not None
    assert resumed.messages == (f"resumed from {resumed.path} at epoch 1, step 6",)
    assert trainer.state is fresh and fresh == TrainState(last_train_loss=1.0)  # the Trainer applies it
    assert manager.check_step(6) is False  # the step it resumed from counts as saved by this run


def test_resume_on_another_world_size_starts_the_random_states_afresh(tmp_path, fake_ckpt):
    (tmp_path / "0001-0006").mkdir()
    fake_ckpt.extra, fake_ckpt.world_size = record(world_size=2), 2
    manager = CheckpointManager(CheckpointConfig(save_dir=str(tmp_path), resume_from=str(tmp_path / "0001-0006")))
    with pytest.warns(TrainerConfigWarning, match="saved by 2 processes, this run has 1: random states start afresh"):
        resumed = manager.resume(fake_trainer())
    assert resumed.rng is None and resumed.state.step == 6


def test_resume_names_the_scheduler_arguments_the_config_changes(tmp_path, fake_ckpt):
    from nnscaler.ckpt import encode_extra
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    saved = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4)
    (tmp_path / "0001-0006").mkdir()
    fake_ckpt.extra = record(lr_scheduler=encode_extra(saved.state_dict()))
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=8)
    manager = CheckpointManager(CheckpointConfig(save_dir=str(tmp_path), resume_from="auto"))
    resumed = manager.resume(fake_trainer(lr_scheduler=scheduler, scheduler_args={"T_max": 8}))
    assert scheduler.T_max == 8
    assert resumed.messages[1] == "lr_scheduler: T_max 4 -> 8 (this run's config; the checkpoint had the former)"


def test_nothing_to_resume_is_none(tmp_path, fake_ckpt):
    for resume_from in (None, "last", "auto"):
        manager = CheckpointManager(CheckpointConfig(save_dir=str(tmp_path), resume_from=resume_from))
        assert manager.resume(fake_trainer()) is None


def test_no_helper_writes_the_trainers_private_attributes():
    """Helpers get the Trainer's public face; what they produce comes back as a result (Resumed,
    Saved) that trainer.py applies."""
    import ast
    from pathlib import Path
    import nnscaler.trainer
    package = Path(nnscaler.trainer.__file__).parent
    writes = []
    for path in package.rglob("*.py"):
        if path.name == "trainer.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            for t in targets:
                if (isinstance(t, ast.Attribute) and t.attr.startswith("_") and isinstance(t.value, ast.Name)
                        and t.value.id == "trainer"):
                    writes.append(f"{path.name}: trainer.{t.attr}")
    assert writes == []


def test_no_save_saves_nothing_at_epoch_ends_either(tmp_path):
    """``no_save: true`` with ``every_n_epochs`` set: no checkpoint (the former loop saved one)."""
    from loop_helpers import config, run_trainer
    _, _, calls = run_trainer(config(tmp_path, max_train_steps=..., max_epochs=1, **{
        "checkpoint.no_save": True, "checkpoint.every_n_epochs": 1}))
    assert "on_save_checkpoint" not in calls and not (tmp_path / "ckpt").exists()
