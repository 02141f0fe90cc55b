"""Errors raised inside generated code point at the user's line: a note names the source line
(the class's ``SOURCE_MAP``) of the deepest generated frame."""
from __future__ import annotations

import os
import sys
from typing import Optional

__all__ = ["NOTE_PREFIX", "generated_file", "note_source"]

NOTE_PREFIX = "nnscaler: raised by "


def generated_file(cls: type) -> Optional[str]:
    """The absolute path of the file that defines `cls` (a generated module), or None."""
    path = getattr(sys.modules.get(cls.__module__), "__file__", None)
    return os.path.abspath(path) if path else None


def note_source(module, exc: BaseException) -> None:
    """Add a note to `exc` naming the user's source line of the deepest frame of `module`'s
    generated file (once)."""
    if any(str(n).startswith(NOTE_PREFIX) for n in getattr(exc, "__notes__", ())):
        return
    generated = generated_file(type(module))
    source_map = module.SOURCE_MAP
    found, tb = None, exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if generated and os.path.abspath(code.co_filename) == generated:
            where = source_map.get(tb.tb_lineno)
            if where is None:  # inside a multi-line statement: nearest mapped line above
                above = [n for n in source_map if code.co_firstlineno <= n < tb.tb_lineno]
                where = source_map[max(above)] if above else None
            if where is not None:
                found = (where, tb.tb_lineno)
        tb = tb.tb_next
    if found:
        note = f"{NOTE_PREFIX}{found[0]}\n  (generated code {generated}:{found[1]})"
        if hasattr(exc, "add_note"):
            exc.add_note(note)
        else:  # Python 3.10
            exc.__notes__ = [*getattr(exc, "__notes__", []), note]
