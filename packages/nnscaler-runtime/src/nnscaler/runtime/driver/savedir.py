"""An unusable ``gen_savedir`` as one clear line: the path, what is wrong, and the fix.

Generation writes into ``<gen_savedir>/<module class>/<instance>/``. When that fails because of the
directory itself (read-only, a file where a directory must be, no space left), the OSError
(``PermissionError: [Errno 13] ...`` with a traceback through nnscaler) is turned into a
`GenerationError` naming ``gen_savedir`` and the fix. OSErrors about other paths (the user's model
reading its own files while traced) are left as they are.
"""
from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Optional

from ..errors import GenerationError

__all__ = ["savedir_error"]


def savedir_error(exc: BaseException, gen_savedir, directory) -> Optional[GenerationError]:
    """The clear error for `exc` when it is an OSError about `gen_savedir` (or the instance
    `directory` under it, or a parent of it), else None."""
    if not isinstance(exc, OSError) or exc.filename is None:
        return None
    root = Path(os.path.abspath(os.fspath(gen_savedir)))
    bad = Path(os.path.abspath(os.fspath(exc.filename)))
    target = Path(os.path.abspath(os.fspath(directory)))
    if not (_within(bad, root) or _within(root, bad) or _within(bad, target)):
        return None
    what = f"gen_savedir {str(root)!r}"
    if isinstance(exc, (NotADirectoryError, FileExistsError)) or exc.errno in (errno.ENOTDIR, errno.EEXIST):
        blocker = next((p for p in [bad, *bad.parents] if p.is_file()), bad)
        return GenerationError(f"{what} cannot hold the generated code: {str(blocker)!r} is a file, not a "
                               f"directory. Pass gen_savedir= a directory path, or move the file away")
    if isinstance(exc, PermissionError) or exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        why = "is on a read-only file system" if exc.errno == errno.EROFS else "is not writable"
        return GenerationError(f"{what} {why} ({str(bad)!r}: {exc.strerror}); nnscaler writes the generated code "
                               f"there. Pass gen_savedir= a writable directory, or make it writable")
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return GenerationError(f"no space left for {what} while writing {str(bad)!r} ({exc.strerror}). Free space "
                               f"there, or pass gen_savedir= a directory on another disk")
    return GenerationError(f"cannot write the generated code into {what}: {exc.strerror or exc} ({str(bad)!r}). "
                           f"Pass gen_savedir= a writable directory")


def _within(path: Path, root: Path) -> bool:
    return path == root or root in path.parents
