"""The trainer's command line: ``nnscaler train``, ``nnscaler compile``, ``python -m nnscaler.trainer``."""
from .main import main

__all__ = ["main"]
