"""Every rank loads its generated code, and all ranks agree it is one program, before any group.

`load_on_every_rank` is the load step of `parallelize()`. Each rank reads its node's manifest,
checks its own ``gencode{rank}.py`` against it and imports it; then (one all-gather of small
JSON records over the default group, so it returns within seconds) every rank sees every rank's
outcome and *program identity*: the graph fingerprint, the compute config, the policy, the module
and class names, the input schema and the SHA-256 of the generated files. If any rank failed
(its node has no code, a transfer could not be written) or holds a program other than rank 0's
(stale code in a node's own gen_savedir), every rank raises the same error naming the node,
its host and the differing field, before a process group is built, so no rank is left waiting in
``new_group`` or a collective.
"""
from __future__ import annotations

import importlib.util
import socket
import sys
from pathlib import Path
from typing import Dict, List, Optional

import torch.distributed as dist

from .broadcast import all_gather_json, local_world_size, node_of
from ..errors import GenerationError, NnScalerError, PlanMismatchError
from nnscaler.ir.contracts import CONSTANTS_FILE, gencode_file, is_gencode_file

from .file_digest import sha256_file
from .gen_dir import read_manifest

IDENTITY_FIELDS = ("module_class", "class_name", "graph_fingerprint", "policy", "compute_config", "input_schema")
_INFORMATIONAL = ("plan_report",)  # files that describe the plan but are not part of the program


def program_identity(manifest: dict) -> dict:
    """What must be equal on every node for the ranks to run one program."""
    files = {n: m["sha256"] for n, m in manifest.get("files", {}).items() if not n.startswith(_INFORMATIONAL)}
    return {**{k: manifest.get(k) for k in IDENTITY_FIELDS}, "files": files}


def identity_differences(ours: dict, theirs: dict) -> List[str]:
    """Readable differences of `theirs` from `ours` (rank 0's); files only where both hold them,
    except the generated modules and constants, which every node must hold."""
    diffs = []
    for key in IDENTITY_FIELDS:
        a, b = ours.get(key), theirs.get(key)
        if key == "compute_config" and isinstance(a, dict) and isinstance(b, dict):
            diffs += [f"compute_config.{k}: rank 0 {a.get(k)!r}, here {b.get(k)!r}"
                      for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        elif a != b:
            diffs.append(f"{key}: rank 0 {a!r}, here {b!r}")
    fa, fb = ours["files"], theirs["files"]
    for name in sorted(set(fa) | set(fb)):
        required = is_gencode_file(name) or name == CONSTANTS_FILE
        if name in fa and name in fb:
            if fa[name] != fb[name]:
                diffs.append(f"{name}: content differs (SHA-256)")
        elif required:
            diffs.append(f"{name}: {'missing here' if name in fa else 'not in rank 0 code'}")
    return diffs


def _load_local(directory: Path, rank: int, strategy: str):
    manifest = read_manifest(directory)
    path = directory / gencode_file(rank)
    if manifest is None or not path.exists():
        hint = ("every node must see rank 0's gen_savedir (a shared file system), or pass "
                "broadcast_strategy='all' (or 'code') to send it") if strategy == "none" \
            else "it should have come from rank 0"
        raise GenerationError(f"generated code for rank {rank} not found in {directory}: {hint}")
    meta = manifest.get("files", {}).get(path.name)
    if meta is None or sha256_file(path) != meta.get("sha256"):
        raise GenerationError(f"{path} does not match its manifest (edited or left from another generation); "
                              f"regenerate with reuse='override' or delete {directory}")
    module_name = f"_nnscaler_gen_{abs(hash(str(directory))):x}_rank{rank}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    gen_cls = getattr(module, manifest["class_name"])
    if gen_cls.GRAPH_FINGERPRINT != manifest.get("graph_fingerprint"):  # the program identity the code carries
        raise GenerationError(f"{path} was generated from graph {gen_cls.GRAPH_FINGERPRINT}, but its manifest "
                              f"records graph {manifest.get('graph_fingerprint')}; regenerate with reuse='override' "
                              f"or delete {directory}")
    return manifest, gen_cls


def _where(statuses: List[dict], node: int) -> str:
    ranks = [s["rank"] for s in statuses if s["node"] == node]
    span = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]}"
    return f"node {node} ({span}, host {statuses[ranks[0]]['host']})"


def load_on_every_rank(directory: Path, rank: int, strategy: str, transfer_error: Optional[str] = None,
                       load: bool = True):
    """Load this rank's generated class (None when `load` is False); raises on every rank together."""
    status: Dict = {"rank": rank, "node": node_of(rank) if dist.is_initialized() else 0,
                    "host": socket.gethostname(), "dir": str(directory), "error": transfer_error, "identity": None}
    gen_cls = None
    if status["error"] is None and load:
        try:
            manifest, gen_cls = _load_local(directory, rank, strategy)
            status["identity"] = program_identity(manifest)
        except Exception as e:  # shared with every rank below; raised here too
            status["error"] = str(e) if isinstance(e, NnScalerError) else f"{type(e).__name__}: {e}"
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        if status["error"] is not None:
            raise GenerationError(status["error"])
        return gen_cls
    statuses = all_gather_json(status)
    failed = [s for s in statuses if s["error"] is not None]
    if failed:
        lines, seen = [], set()
        for s in failed:
            key = (s["node"], s["error"].replace(f"rank {s['rank']}", "rank ?"))
            if key not in seen:
                seen.add(key)
                lines.append(f"  {_where(statuses, s['node'])}: {s['error']}")
        raise GenerationError(f"parallelize() failed to share or load the generated code on {len(failed)} of "
                              f"{len(statuses)} ranks (every rank raises this):\n" + "\n".join(lines))
    if not load:
        return None
    reference = statuses[0]["identity"]
    wrong = {}
    for s in statuses[1:]:
        diffs = identity_differences(reference, s["identity"])
        if diffs:
            wrong.setdefault(s["node"], (s, diffs))
    if wrong:
        lines = []
        for node, (s, diffs) in sorted(wrong.items()):
            lines.append(f"  {_where(statuses, node)}, {s['dir']}: " + "; ".join(diffs[:6])
                         + (f"; ... ({len(diffs) - 6} more)" if len(diffs) > 6 else ""))
        hint = ("with broadcast_strategy='none' each node loads the code in its own gen_savedir: delete the "
                "stale copy there, share rank 0's gen_savedir, or pass broadcast_strategy='all' (or 'code')")
        raise PlanMismatchError(f"the generated code on {len(wrong)} node(s) is not rank 0's program "
                                f"({statuses[0]['dir']}):\n" + "\n".join(lines) + f"\n{hint}")
    return gen_cls
