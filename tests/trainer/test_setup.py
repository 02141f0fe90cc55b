"""The Trainer's set-up helpers (trainer/setup.py) that need no training run."""
from __future__ import annotations

import socket

import torch.distributed as dist

from nnscaler.runtime.grid import default_timeout
from nnscaler.trainer import TrainerArgs
from nnscaler.trainer.setup import init_distributed


def test_collective_timeout_defaults_to_torchs_nccl_default():
    assert TrainerArgs.__dataclass_fields__["collective_timeout"].default == 600


def test_the_process_group_gets_the_collective_timeout(monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    assert init_distributed(1, 7.5)
    try:
        assert default_timeout().total_seconds() == 7.5  # what nnscaler's waits and groups honour
    finally:
        dist.destroy_process_group()
