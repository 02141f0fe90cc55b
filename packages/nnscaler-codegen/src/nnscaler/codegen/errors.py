"""Errors of code generation: `GenerationError`, one class shared with the runtime (nnscaler.ir.errors)."""
from nnscaler.ir import GenerationError

__all__ = ["GenerationError"]
