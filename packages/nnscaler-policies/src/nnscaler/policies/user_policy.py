"""Calling a policy function: a user's policy that fails shows the user's frame first, and one that
returns the wrong object is told what it must return.

A user policy that raises is reported as a `PlanError` whose message starts with the user's frames
(file, line, code) down to where the exception was raised, then the exception; the original stays
chained as ``__cause__``. `parallelize` shows deliberate errors as one message, so what the user
sees is their own line. A `PlanError` the primitives raise (a bad partition) keeps its message and
gains the line of the user's policy that called the primitive. A built-in policy's exception is not
rewrapped: an internal error keeps its full traceback.
"""
from __future__ import annotations

import traceback
from typing import Callable

from nnscaler.ir import IRGraph
from nnscaler.ir import is_internal

from .plan import PlanError

__all__ = ["call_policy"]


def call_policy(fn: Callable, graph: IRGraph, compute_config, name: str) -> IRGraph:
    """``fn(graph, compute_config)``, the graph it returns (None means the graph, changed in place)."""
    user = _is_user_function(fn)
    try:
        result = fn(graph, compute_config)
    except Exception as e:
        if not user:
            raise
        frames = [f for f in traceback.extract_tb(e.__traceback__) if not is_internal(f.filename)]
        where = "".join(traceback.format_list(frames)).rstrip()
        if isinstance(e, PlanError):
            last = frames[-1] if frames else None
            at = f" (called from your policy at {last.filename}:{last.lineno}: {last.line})" if last else ""
            raise PlanError(f"{e}{at}") from e
        raise PlanError(f"policy {name!r} raised {type(e).__name__}: {e}\n"
                        f"Traceback of the policy (most recent call last):\n{where}\n"
                        f"{type(e).__name__}: {e}") from e
    if result is None:
        return graph
    if not isinstance(result, IRGraph):
        raise PlanError(f"policy {name!r} returned {type(result).__name__} {_short(result)}; a policy must "
                        f"return the graph it was given (planned with partition/replicate/assign), or None")
    return result


def _is_user_function(fn) -> bool:
    code = getattr(fn, "__code__", None) or getattr(getattr(fn, "__call__", None), "__code__", None)
    return code is not None and not is_internal(code.co_filename)


def _short(obj) -> str:
    text = repr(obj)
    return text if len(text) <= 60 else text[:57] + "..."
