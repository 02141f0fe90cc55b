"""The SHA-256 of a file, read in 1 MiB chunks: what the generated-code manifest (gen_dir.py) and
the recorded model sources (model_sources.py) both compare."""
from __future__ import annotations

import hashlib
from pathlib import Path

__all__ = ["sha256_file"]


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
