"""Loggers: TensorBoard event files hold the logged scalars; W&B needs its package; the console line."""
from __future__ import annotations

import importlib.util
import os
import sys

import pytest

from loop_helpers import config, run_trainer
from nnscaler.trainer import TrainerError, TrainStepMetrics, WandbLogger
from nnscaler.trainer.loggers.console import ConsoleReporter, format_train_line
from nnscaler.trainer.loggers.event_file import EventFileWriter, crc32c, read_scalars


def test_crc32c_known_value():
    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value


def test_event_file_round_trip(tmp_path):
    w = EventFileWriter(str(tmp_path))
    w.add_scalars({"loss": 1.5, "lr": 0.25}, step=3)
    w.close()
    assert read_scalars(w.path) == [(3, "loss", 1.5), (3, "lr", 0.25)]
    with open(w.path, "r+b") as f:  # a flipped byte is caught
        f.seek(-6, os.SEEK_END)
        byte = f.read(1)
        f.seek(-6, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(ValueError, match="CRC"):
        read_scalars(w.path)


def test_tensorboard_logger_writes_train_and_val(tmp_path):
    data = config(tmp_path, max_train_steps=4, hook=..., **{
        "dataset.val_args": {"size": 8, "seed": 1}, "val_every_n_train_steps": 2,
        "log": [{"type": "nnscaler.trainer.TensorBoardLogger", "args": {"root_dir": str(tmp_path / "tb"), "name": "run"}}]})
    run_trainer(data)
    root = tmp_path / "tb" / "run"
    (train_file,) = (root / "train").iterdir()
    (val_file,) = (root / "val").iterdir()
    train = read_scalars(str(train_file))
    assert [s for s, tag, _ in train if tag == "loss"] == [1, 2, 3, 4]
    assert {"loss", "lr", "gnorm", "samples_per_s", "step_time_s"} <= {tag for _, tag, _ in train}
    assert [s for s, tag, _ in read_scalars(str(val_file)) if tag == "loss"] == [2, 4]
    assert (root / "train_config.yaml").read_text().startswith("compute_config:")


def test_wandb_logger_without_wandb_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as where it is not installed: import fails
    with pytest.raises(TrainerError, match="pip install wandb"):
        WandbLogger().setup({})


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb is not installed")
def test_wandb_offline(tmp_path):
    logger = WandbLogger(dir=str(tmp_path), mode="offline")
    logger.setup({"a": 1})
    logger.log_metrics({"loss": 1.0}, 1, "train")
    logger.finalize()
    assert list(tmp_path.rglob("*.wandb"))


def test_console_line_and_progress(tmp_path):
    m = TrainStepMetrics(epoch=1, step=3, train_loss=0.5, lr=1e-3, gnorm=0.25, samples_per_s=100.0,
                         tokens_per_s=2000.0, step_time_s=0.01, memory_mb=64)
    assert format_train_line(m, 10) == ("epoch 1 step 3/10 | loss 0.5000 | lr 1.00e-03 | gnorm 0.250 | "
                                        "100.0 samples/s | 2000 tokens/s | 10.0 ms/step | mem 64 MB")
    out = tmp_path / "out.txt"
    with open(out, "w") as f:
        reporter = ConsoleReporter(True, True, 10, stream=f)
        reporter.train_step(m, 3)
        reporter.close()
    text = out.read_text()
    assert "epoch 1 step 3/10" in text and "3/10" in text and "train" in text


def test_event_file_reads_in_tensorboard_itself(tmp_path):
    """TensorBoard's own reader sees the scalars our writer wrote (the format, not just our reader)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    w = EventFileWriter(str(tmp_path))
    w.add_scalars({"loss": 1.5, "lr": 0.25}, step=3)
    w.add_scalars({"loss": 1.25}, step=4)
    w.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert sorted(acc.Tags()["scalars"]) == ["loss", "lr"]
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(3, 1.5), (4, 1.25)]
