"""Pointing at the user's code: the first stack frame outside nnscaler and torch."""
from __future__ import annotations

import os
import sys
import warnings
from typing import Dict, Tuple

import torch

_INTERNAL = (os.path.dirname(torch.__file__), os.path.dirname(warnings.__file__))

# The tracer asks for every recorded op (its source line walks the stack), so the answers are
# cached: per file name, for the nnscaler directories they were computed with (nnscaler.__path__
# grows when another part is installed, e.g. by pkgutil.extend_path).
_dirs: Tuple[tuple, tuple] = ((), ())  # (nnscaler.__path__ as a tuple, its directories)
_verdicts: Dict[str, bool] = {}


def _nnscaler_dirs() -> tuple:
    global _dirs
    import nnscaler
    paths = tuple(nnscaler.__path__)
    if paths != _dirs[0]:
        _dirs = (paths, tuple(os.path.abspath(p) + os.sep for p in paths))
        _verdicts.clear()
    return _dirs[1]


def is_internal(filename: str) -> bool:
    """Whether a frame's file belongs to nnscaler (any part), torch or the standard library."""
    dirs = _nnscaler_dirs()
    verdict = _verdicts.get(filename)
    if verdict is None:
        verdict = _verdicts[filename] = (filename.startswith("<") or filename.startswith(_INTERNAL)
                                         or filename.startswith(dirs))
    return verdict


def warn_user(message: str, category=UserWarning) -> None:
    """`warnings.warn` attributed to the first frame of the user's code."""
    level, frame = 2, sys._getframe(1)
    while frame is not None and is_internal(frame.f_code.co_filename):
        frame = frame.f_back
        level += 1
    warnings.warn(message, category, stacklevel=level)
