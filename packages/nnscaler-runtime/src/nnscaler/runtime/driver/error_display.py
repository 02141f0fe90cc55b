"""Which errors `parallelize` shows as one message and which keep their traceback.

A *deliberate* error names the user's thing and the fix; its traceback through nnscaler only hides
the message, so `parallelize` cuts it at the user's call. An *internal* error (a bug) needs its
traceback to be found and fixed, so it is left whole. Deliberate are:

* nnscaler's own exception classes (`NnScalerError`, the IR's ConfigError / TraceError /
  AnnotationError, the policies' PlanError...): any exception class defined in an ``nnscaler``
  module;
* a plain TypeError or ValueError raised by a ``raise`` statement in nnscaler's own code (its
  argument checks). The same classes raised by an expression that failed (``int(None)`` inside
  nnscaler) or by the user's code (their model, their policy) are not deliberate: their traceback
  is what explains them.
"""
from __future__ import annotations

import linecache

__all__ = ["is_deliberate"]


def is_deliberate(exc: BaseException) -> bool:
    """Whether `exc` is an error nnscaler raised on purpose (shown as one message)."""
    from nnscaler.ir import NnScalerError
    if isinstance(exc, NnScalerError) or type(exc).__module__.startswith("nnscaler."):
        return True
    if type(exc) not in (TypeError, ValueError):
        return False
    tb = exc.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    code = tb.tb_frame.f_code
    from nnscaler.ir import is_internal
    if not is_internal(code.co_filename) or _is_library(code.co_filename):
        return False
    line = linecache.getline(code.co_filename, tb.tb_lineno).strip()
    return line.startswith("raise ")


def _is_library(filename: str) -> bool:
    """torch or the standard library (is_internal covers them too): not nnscaler's own raise."""
    import os
    import nnscaler
    return not filename.startswith(tuple(os.path.abspath(p) + os.sep for p in nnscaler.__path__))
