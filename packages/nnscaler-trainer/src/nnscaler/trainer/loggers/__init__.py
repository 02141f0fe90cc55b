"""Loggers: the interface, TensorBoard (event files), Weights & Biases, the console."""
from .base import LoggerBase
from .console import ConsoleReporter
from .tensorboard import TensorBoardLogger
from .wandb import WandbLogger

__all__ = ["LoggerBase", "ConsoleReporter", "TensorBoardLogger", "WandbLogger"]
