"""The model's source files in the manifest, and what changed since generation.

A reuse *match* is defined by the configuration (`ReuseType` in gen_dir.py), not by the
model's code, so an edited ``forward`` with the same config would silently run the program traced
from the old code. Generation therefore records, in ``manifest.json`` under ``"sources"``, the
path and SHA-256 of

- the file of every class in ``module.modules()``;
- the file of every user function the graph calls by name (custom ops from ``register_op``,
  kept ``torch.autograd.Function`` s): the module of the node's dotted target;
- the file of every user line an op was traced from (helpers the forward calls).

Files of torch, nnscaler and the standard library are left out: nnscaler's own are covered by the
manifest's ``generator`` hash, and torch's run as installed. Installed packages (transformers'
modeling files) are recorded: an upgrade that changes them changes the model.

`changed_sources` compares the record with the files now: a changed or (for an instance) newly
used file is reported; a recorded file that does not exist here (a runtime-only machine without
the model's files) is not a change, it is logged at INFO level.
"""
from __future__ import annotations

import functools
import inspect
import logging
import os
import sys
from typing import Dict, Iterable, List, Optional

import torch

from nnscaler.ir import NnScalerWarning

from .file_digest import sha256_file

__all__ = ["SourceChangedWarning", "collect_sources", "changed_sources", "describe_changes"]

log = logging.getLogger("nnscaler")


class SourceChangedWarning(NnScalerWarning):
    """``reuse='match'`` reuses generated code although a source file of the model (a module
    class, a custom op, a traced line) changed since the code was generated: the code runs the
    model as it was then. The message names the file(s); ``reuse='moo'`` or ``'override'``
    regenerates."""


@functools.lru_cache(maxsize=1)
def _excluded_roots() -> tuple:
    import sysconfig
    import nnscaler
    roots = [os.path.dirname(torch.__file__), *nnscaler.__path__]
    return tuple(os.path.abspath(r) + os.sep for r in roots), os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep


def _user_file(path: Optional[str]) -> Optional[str]:
    """`path` made absolute when it is a model source to record: not torch, nnscaler or the
    standard library (installed packages such as transformers are recorded)."""
    if not path or path.startswith("<"):
        return None
    path = os.path.abspath(path)
    roots, stdlib = _excluded_roots()
    if path.startswith(roots) or not os.path.isfile(path):
        return None
    if path.startswith(stdlib) and not any(d in path.split(os.sep) for d in ("site-packages", "dist-packages")):
        return None
    return path


def _class_file(cls) -> Optional[str]:
    try:
        return _user_file(inspect.getsourcefile(cls))
    except (TypeError, OSError):
        return None


def _target_file(target: str) -> Optional[str]:
    """The file of the module a dotted node target lives in (the longest imported prefix)."""
    parts = target.split(".")
    for n in range(len(parts) - 1, 0, -1):
        mod = sys.modules.get(".".join(parts[:n]))
        if mod is not None:
            return _user_file(getattr(mod, "__file__", None))
    return None


def class_files(module: torch.nn.Module) -> Dict[str, str]:
    """path -> why, for the classes of `module.modules()` defined outside torch/nnscaler."""
    out: Dict[str, str] = {}
    for cls in dict.fromkeys(type(m) for m in module.modules()):
        path = _class_file(cls)
        if path is not None:
            out.setdefault(path, f"module class {cls.__module__}.{cls.__qualname__}")
    return out


def collect_sources(module: Optional[torch.nn.Module], graph=None) -> List[dict]:
    """The ``"sources"`` entry of a manifest: ``[{"path", "sha256", "why"}]`` sorted by path."""
    found: Dict[str, str] = class_files(module) if module is not None else {}
    seen = set()
    for node in getattr(graph, "nodes", ()) or ():
        if node.target not in seen and not node.target.startswith(("torch.", "operator.", "math.")):
            seen.add(node.target)
            path = _target_file(node.target)
            if path is not None:
                found.setdefault(path, f"function {node.target}")
        src_file = getattr(getattr(node, "source", None), "file", None)
        if src_file not in seen:
            seen.add(src_file)
            path = _user_file(src_file)
            if path is not None:
                found.setdefault(path, "traced code")
    return [{"path": p, "sha256": sha256_file(p), "why": why} for p, why in sorted(found.items())]


def changed_sources(recorded: Optional[Iterable[dict]], module: Optional[torch.nn.Module] = None
                    ) -> Dict[str, str]:
    """path -> what changed, comparing a manifest's ``"sources"`` with the files now.

    `recorded` None (code from an nnscaler that did not record sources) checks nothing. A
    recorded file missing here is skipped (logged). With `module` (an instance), a class file it
    uses that was not recorded counts as a change too."""
    if recorded is None:
        return {}
    changes: Dict[str, str] = {}
    paths, digests = set(), set()
    for entry in recorded:
        path = entry.get("path")
        if not isinstance(path, str):
            continue
        paths.add(path)
        digests.add(entry.get("sha256"))
        if not os.path.isfile(path):
            log.info("nnscaler: %s (%s) recorded at generation is not on this machine; not checked",
                     path, entry.get("why", "model source"))
            continue
        if sha256_file(path) != entry.get("sha256"):
            changes[path] = f"changed since generation ({entry.get('why', 'model source')})"
    if module is not None:
        for path, why in class_files(module).items():
            # a file at another path with a recorded content (the model checked out elsewhere) is the same
            if path not in paths and sha256_file(path) not in digests:
                changes[path] = f"not used when the code was generated ({why})"
    return changes


def describe_changes(changes: Dict[str, str]) -> str:
    return "; ".join(f"{path} {what}" for path, what in sorted(changes.items()))
