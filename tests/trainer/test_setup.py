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


def test_use_zero_3_refuses_trainable_parameters_outside_the_parallel_modules():
    import pytest
    import torch

    from nnscaler.runtime import ParallelModule
    from nnscaler.trainer.errors import TrainerError
    from nnscaler.trainer.setup import _refuse_unsharded_trainables

    class Sharded(ParallelModule):
        COMPUTE_CONFIG = {"plan_ngpus": 1, "runtime_ngpus": 1, "use_zero": 3}

        def __init__(self):
            super().__init__()
            self.register_parameter("w", torch.nn.Parameter(torch.zeros(2)))
            self.add_full_map("w", "body.w", full_shape=(2,), slices=((0, 2),))
            self._post_init(False)

    model = torch.nn.Module()
    model.body, model.head = Sharded(), torch.nn.Linear(2, 2)
    with pytest.raises(TrainerError, match=r"outside model.parallel_modules \(head.weight, head.bias\).*use_zero: true"):
        _refuse_unsharded_trainables(model)
    model.head.requires_grad_(False)
    _refuse_unsharded_trainables(model)  # frozen neighbours are fine
