"""WandbLogger: Weights & Biases, offline by default (works with no network)."""
from __future__ import annotations

from typing import Any, Dict, Optional

from ..errors import TrainerError
from .base import LoggerBase

__all__ = ["WandbLogger"]


class WandbLogger(LoggerBase):
    """``wandb.init(project=..., name=..., dir=..., mode=...)``; metrics logged as ``train/loss``,
    ``val/loss``, ... Needs the ``wandb`` package (``pip install wandb``)."""

    def __init__(self, project: str = "nnscaler", name: Optional[str] = None, dir: Optional[str] = None,
                 mode: str = "offline", **init_kwargs: Any):
        self.init_kwargs = dict(init_kwargs, project=project, name=name, dir=dir, mode=mode)
        self.run = None

    def setup(self, config: Dict[str, Any]) -> None:
        try:
            import wandb
        except ImportError:
            raise TrainerError("log: WandbLogger needs the wandb package: `pip install wandb` "
                               "(or remove the logger from the config)") from None
        self.run = wandb.init(config=config, **{k: v for k, v in self.init_kwargs.items() if v is not None})

    def log_metrics(self, metrics: Dict[str, float], step: int, tag: str) -> None:
        self.run.log({f"{tag}/{k}": v for k, v in metrics.items()}, step=step)

    def finalize(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
