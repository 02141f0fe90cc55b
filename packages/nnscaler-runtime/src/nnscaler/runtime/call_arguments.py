"""A call of the parallelized module whose arguments do not fit the model's forward.

The generated ``_forward_impl`` has the signature of the user's ``forward`` as traced, so a missing,
extra or doubled argument makes Python refuse the call with a message naming ``_forward_impl``, an
internal name. `call_error` turns that into an error naming the user's ``forward`` and its signature.
It runs only after the call has raised: a call whose arguments fit pays nothing.
"""
from __future__ import annotations

import inspect
from typing import Any, Mapping, Optional, Sequence

from .errors import NnScalerError

__all__ = ["ForwardArgumentError", "call_error"]


class ForwardArgumentError(NnScalerError, TypeError):
    """The arguments of a call of a parallelized module do not fit the model's forward."""


def call_error(module, exc: BaseException, args: Sequence[Any], kwargs: Mapping[str, Any]
               ) -> Optional[ForwardArgumentError]:
    """The error to raise instead of `exc` when `exc` is Python refusing the call's arguments, else None."""
    if not isinstance(exc, TypeError) or isinstance(exc, NnScalerError):
        return None
    signature = inspect.signature(module._forward_impl)
    try:
        signature.bind(*args, **kwargs)
    except TypeError as refusal:
        reason = str(refusal)
    else:
        return None  # the arguments fit: the TypeError comes from inside forward
    name = type(module).__name__
    given = [f"{len(args)} positional"] if args else []
    given += [f"{k}=" for k in kwargs]
    return ForwardArgumentError(
        f"{name}.forward{signature}: {reason} (the call passed {', '.join(given) or 'no arguments'}). The "
        f"parallelized module takes the arguments of {name}.forward as it was traced, by position or by name; "
        f"to change the arguments, change forward and generate again (reuse='override')")
