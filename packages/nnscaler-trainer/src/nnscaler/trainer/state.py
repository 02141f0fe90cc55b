"""What exact resume needs besides weights: counters and the data position.

The RNG states (torch CPU and CUDA, NumPy, Python ``random``, every ParallelModule's stream) are
saved and restored by nnscaler.ckpt (``nnscaler.ckpt.rng``); the scheduler's and scaler's states
travel through ``nnscaler.ckpt.encode_extra``.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Dict, Iterator, Optional

import torch

__all__ = ["TrainState", "SkippingSampler"]


@dataclass
class TrainState:
    """Counters of a run. ``epoch`` / ``idx_in_epoch`` is the next data position to read."""

    epoch: int = 0
    idx_in_epoch: int = 0  # optimizer steps already taken in `epoch`
    samples_in_epoch: int = 0  # samples all ranks together have read in `epoch` (data_position)
    step: int = 0  # optimizer steps taken in total
    best_val_loss: Optional[float] = None
    last_val_loss: Optional[float] = None
    last_train_loss: Optional[float] = None

    @property
    def current_epoch(self) -> int:
        """The epoch the last step belongs to (``epoch`` already points past a finished one)."""
        return self.epoch - 1 if self.idx_in_epoch == 0 and self.epoch > 0 else self.epoch

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> "TrainState":
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


class SkippingSampler(torch.utils.data.Sampler):
    """Wraps a sampler; after `skip(n)` the next epoch's iteration leaves out its first n indices
    (to resume mid-epoch without reading the skipped data). `set_epoch` and `len` pass through."""

    def __init__(self, sampler):
        self.sampler = sampler
        self._skip = 0

    def skip(self, n: int) -> None:
        self._skip = n

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        skip, self._skip = self._skip, 0
        for i, index in enumerate(self.sampler):
            if i >= skip:
                yield index

    def __len__(self) -> int:
        return len(self.sampler) - self._skip
