"""The environment ``nnscaler train --nproc N`` gives the worker processes it starts.

- ``OMP_NUM_THREADS``: max(1, cores // N) (N processes share the machine's cores).
- glibc's malloc thresholds, `MALLOC_ENV`: every allocation above 64 KiB gets its own mapping,
  unmapped when freed, and free heap memory above 128 KiB is handed back. With glibc's defaults
  a freed block (a gathered `use_zero=3` unit, activations, a dropped optimizer step's temporaries)
  often stays in the process's resident set, so sharding saved memory on paper only; glibc reads
  these variables when a process starts, hence the launcher sets them for its workers.

Nothing is changed that the user set: an ``OMP_NUM_THREADS`` of their own stays; any of the two
malloc variables, or a ``glibc.malloc.`` tunable in ``GLIBC_TUNABLES``, leaves malloc to them;
``NNSCALER_GLIBC_MALLOC_DEFAULTS=1`` keeps glibc's defaults (docs/fully-sharded.md, "Memory of a
process")."""
from __future__ import annotations

import os
from typing import Dict, MutableMapping, Optional

__all__ = ["MALLOC_ENV", "OPT_OUT", "worker_env"]

MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "131072"}
OPT_OUT = "NNSCALER_GLIBC_MALLOC_DEFAULTS"


def _malloc_set_by_user(environ: MutableMapping[str, str]) -> bool:
    return (any(k in environ for k in MALLOC_ENV) or "glibc.malloc." in environ.get("GLIBC_TUNABLES", "")
            or environ.get(OPT_OUT, "").strip().lower() not in ("", "0", "false", "no"))


def worker_env(nproc: int, environ: Optional[MutableMapping[str, str]] = None) -> Dict[str, str]:
    """Set in `environ` (``os.environ``: the workers inherit it) what the workers of an `nproc`-process
    launch need and the user did not set; returns what was set."""
    environ = os.environ if environ is None else environ
    wanted = {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // nproc))}
    if not _malloc_set_by_user(environ):
        wanted.update(MALLOC_ENV)
    added = {k: v for k, v in wanted.items() if k not in environ}
    environ.update(added)
    return added
