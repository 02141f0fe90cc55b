"""Sharing rank 0's generated files with the other nodes (`broadcast_strategy`).

A node is a group of LOCAL_WORLD_SIZE consecutive ranks (torchrun's layout). Rank 0 generates;
the first rank of every other node receives the files and writes them into its own gen_savedir.

- ``none``: nothing is sent: every node must already see rank 0's gen_savedir (shared storage);
- ``all``: every file, initial weights included;
- ``no_weights``: every file but ``fullmodel.safetensors`` (build with ``init_params=False`` and
  load a checkpoint);
- ``code``: only the generated modules, the graph constants and the manifest.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import List

import torch.distributed as dist

from .gen_dir import CONSTANTS_FILE, MANIFEST, WEIGHTS_FILE

STRATEGIES = ("none", "all", "no_weights", "code")


def check_strategy(strategy) -> str:
    value = getattr(strategy, "value", strategy)
    if value not in STRATEGIES:
        raise ValueError(f"broadcast_strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    return value


def files_to_send(directory: Path, strategy: str) -> List[str]:
    names = sorted(p.name for p in directory.iterdir() if p.is_file() and not p.name.endswith(".tmp"))
    if strategy == "all":
        return names
    if strategy == "no_weights":
        return [n for n in names if n != WEIGHTS_FILE]
    if strategy == "code":
        return [n for n in names if n.startswith("gencode") or n in (CONSTANTS_FILE, MANIFEST)]
    return []


def node_leader(rank: int) -> bool:
    """Whether `rank` is the first rank of its node."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size() if dist.is_initialized() else 1))
    return rank % max(local_world, 1) == 0


def broadcast_files(directory: Path, strategy: str, rank: int) -> None:
    """Collective: send rank 0's files of `directory` to the first rank of every other node."""
    if strategy == "none" or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    leaders = [None] * dist.get_world_size()
    dist.all_gather_object(leaders, node_leader(rank))
    if sum(bool(x) for x in leaders) <= 1:
        return  # one node: it already sees rank 0's files
    payload = [None]
    if rank == 0:
        payload = [{name: (directory / name).read_bytes() for name in files_to_send(directory, strategy)}]
    dist.broadcast_object_list(payload, src=0)
    if rank != 0 and leaders[rank]:
        directory.mkdir(parents=True, exist_ok=True)
        files = payload[0]
        # The manifest goes last: it is what makes the directory valid.
        for name in sorted(files, key=lambda n: n == MANIFEST):
            tmp = directory / (name + ".tmp")
            tmp.write_bytes(files[name])
            os.replace(tmp, directory / name)
