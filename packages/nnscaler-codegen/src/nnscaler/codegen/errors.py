"""Errors of code generation."""


class GenerationError(RuntimeError):
    """The planned graph cannot be turned into code; the message names the op and the reason."""
