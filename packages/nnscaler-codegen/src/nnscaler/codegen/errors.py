"""Errors of code generation: `GenerationError`, one class shared with the runtime (nnscaler.ir.errors)."""
from nnscaler.ir.errors import GenerationError

__all__ = ["GenerationError"]
