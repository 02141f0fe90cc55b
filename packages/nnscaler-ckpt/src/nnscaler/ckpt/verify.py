"""`verify(path)`: every file of a checkpoint is there, with the size and SHA-256 the manifest
records, and nothing is left over that the manifest does not list."""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Dict, Iterable, Optional

from .errors import CheckpointError
from .manifest import read_manifest, sha256_file

__all__ = ["verify", "check_file", "read_checked"]

_CHUNK = 64 * 2**20


def check_file(root: Path, name: str, record: Dict[str, Any], hash_: bool = True) -> None:
    """Raise CheckpointError when file `name` is missing, has another size or (with `hash_`) another SHA-256."""
    path = root / name
    if not path.is_file():
        raise CheckpointError(f"{path} is missing (the manifest lists it): the checkpoint is incomplete; copy the "
                              f"file back or use an earlier checkpoint")
    size = path.stat().st_size
    if size != record["size"]:
        raise CheckpointError(f"{path} has {size} bytes, the manifest records {record['size']} (truncated or "
                              f"replaced): copy the file back or use an earlier checkpoint")
    if hash_ and sha256_file(path) != record["sha256"]:
        raise CheckpointError(f"{path} does not match its SHA-256 in the manifest (corrupted): copy the file back "
                              f"or use an earlier checkpoint")


def read_checked(root: Path, name: str, record: Dict[str, Any], hash_: bool = True):
    """The whole file as a uint8 tensor, hashed (in a helper thread) while it is read: one pass
    instead of a check then a read (without `hash_`: memory-mapped). Raises like `check_file`."""
    import threading

    import torch
    check_file(root, name, record, hash_=False)
    if not hash_:  # nothing to hash: map the file (copy-on-write) instead of reading it
        import mmap
        with open(root / name, "rb") as f:
            if record["size"] == 0:
                return torch.empty(0, dtype=torch.uint8)
            return torch.frombuffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY), dtype=torch.uint8)
    data = torch.empty(record["size"], dtype=torch.uint8)
    view = memoryview(data.numpy()).cast("B")
    h, worker = hashlib.sha256(), None
    with open(root / name, "rb", buffering=0) as f:
        for start in range(0, len(view), _CHUNK):
            chunk = view[start:start + _CHUNK]
            got = 0
            while got < len(chunk):
                n = f.readinto(chunk[got:])
                if not n:
                    raise CheckpointError(f"{root / name} ended early while reading: copy the file back or use an "
                                          f"earlier checkpoint")
                got += n
            if hash_:
                if worker is not None:
                    worker.join()
                worker = threading.Thread(target=h.update, args=(chunk,), daemon=True)
                worker.start()
    if worker is not None:
        worker.join()
    if hash_ and h.hexdigest() != record["sha256"]:
        raise CheckpointError(f"{root / name} does not match its SHA-256 in the manifest (corrupted): copy the file back "
                              f"or use an earlier checkpoint")
    return data


def verify(path, files: Optional[Iterable[str]] = None) -> Dict[str, Any]:
    """Check the manifest and the size and SHA-256 of every file (or only `files`); returns the
    manifest. Raises CheckpointError naming the first bad file and the fix."""
    root = Path(path)
    manifest = read_manifest(root)
    records = manifest["files"]
    for name in (records if files is None else files):
        if name not in records:
            raise CheckpointError(f"{root / name} is not listed in {root / 'manifest.json'}")
        check_file(root, name, records[name])
    return manifest
