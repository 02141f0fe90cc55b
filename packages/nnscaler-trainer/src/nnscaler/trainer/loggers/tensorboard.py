"""TensorBoardLogger: scalars of every logged step in ``<root_dir>/<name>/train`` and ``.../val``."""
from __future__ import annotations

import os
from typing import Any, Dict, Optional

from .base import LoggerBase
from .event_file import EventFileWriter
from ..config.loading import dump_yaml

__all__ = ["TensorBoardLogger"]


class TensorBoardLogger(LoggerBase):
    """Writes TensorBoard event files (no tensorboard package needed to write them);
    open them with ``tensorboard --logdir <root_dir>``."""

    def __init__(self, root_dir: str = "./tb_logs", name: Optional[str] = None, flush_every: int = 1):
        self.dir = os.path.join(root_dir, name) if name else root_dir
        self.flush_every = flush_every
        self._writers: Dict[str, EventFileWriter] = {}
        self._count = 0

    def setup(self, config: Dict[str, Any]) -> None:
        """Creates the directory and saves the resolved config there (``train_config.yaml``)."""
        os.makedirs(self.dir, exist_ok=True)
        with open(os.path.join(self.dir, "train_config.yaml"), "w", encoding="utf-8") as f:
            f.write(dump_yaml(config))

    def log_metrics(self, metrics: Dict[str, float], step: int, tag: str) -> None:
        writer = self._writers.get(tag)
        if writer is None:
            writer = self._writers[tag] = EventFileWriter(os.path.join(self.dir, tag))
        writer.add_scalars(metrics, step)
        self._count += 1
        if self._count % self.flush_every == 0:
            writer.flush()

    def finalize(self) -> None:
        for writer in self._writers.values():
            writer.close()
        self._writers.clear()
