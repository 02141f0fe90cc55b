"""Pointing at the user's code: the first stack frame outside nnscaler and torch."""
from __future__ import annotations

import os
import sys
import warnings

import torch

_INTERNAL = (os.path.dirname(torch.__file__), os.path.dirname(warnings.__file__))


def _nnscaler_dirs() -> tuple:
    import nnscaler
    return tuple(os.path.abspath(p) + os.sep for p in list(nnscaler.__path__))


def is_internal(filename: str) -> bool:
    """Whether a frame's file belongs to nnscaler (any part), torch or the standard library."""
    if filename.startswith("<"):
        return True
    return filename.startswith(_INTERNAL) or filename.startswith(_nnscaler_dirs())


def warn_user(message: str, category=UserWarning) -> None:
    """`warnings.warn` attributed to the first frame of the user's code."""
    level, frame = 2, sys._getframe(1)
    while frame is not None and is_internal(frame.f_code.co_filename):
        frame = frame.f_back
        level += 1
    warnings.warn(message, category, stacklevel=level)
