"""Sharing rank 0's generated files with the other nodes (`broadcast_strategy`).

A node is a group of LOCAL_WORLD_SIZE consecutive ranks (torchrun's layout). Rank 0 generates;
the first rank of every other node (its *leader*) receives the files and writes them into its own
gen_savedir; the node's other ranks read them from there. Files travel once per node, point to
point from rank 0 as raw bytes (no pickle) in messages of `CHUNK` (16 MiB), so rank 0 and the
leaders hold about two chunks of a file in memory and the node's other ranks none
(bench/broadcast_memory.py).

- ``none``: nothing is sent: every node must already hold rank 0's code (shared storage, or the
  same code generated earlier). Whether it does is checked at load time (runtime/driver/load_check.py);
- ``all``: every file, initial weights included;
- ``no_weights``: every file but ``fullmodel.safetensors`` (build with ``init_params=False`` and
  load a checkpoint);
- ``code``: only the generated modules, the graph constants and the manifest.

A receiving node's directory then holds exactly what it received (older files there are removed)
and its manifest lists only those files, with ``received`` = ``{"strategy", "omitted"}``: it
describes what the node holds, so a relaunch where that node becomes rank 0 can reuse it.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import List, Optional

import torch
import torch.distributed as dist

from nnscaler.ir import TMP_SUFFIX, AtomicFile, atomic_write

from nnscaler.ir.contracts import CONSTANTS_FILE, GRAPH_FILE, MANIFEST, WEIGHTS_FILE, is_gencode_file

STRATEGIES = ("none", "all", "no_weights", "code")
CHUNK = 16 << 20  # bytes per message: a rank holds at most this much of a file in memory


def check_strategy(strategy) -> str:
    value = getattr(strategy, "value", strategy)
    if value not in STRATEGIES:
        raise ValueError(f"broadcast_strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    return value


def files_to_send(directory: Path, strategy: str) -> List[str]:
    names = sorted(p.name for p in directory.iterdir() if p.is_file() and not p.name.endswith(TMP_SUFFIX))
    if strategy == "all":
        return names
    if strategy == "no_weights":
        return [n for n in names if n != WEIGHTS_FILE]
    if strategy == "code":
        return [n for n in names if is_gencode_file(n) or n in (CONSTANTS_FILE, MANIFEST)]
    return []


def local_world_size() -> int:
    world = dist.get_world_size() if dist.is_initialized() else 1
    return max(int(os.environ.get("LOCAL_WORLD_SIZE", world)), 1)


def node_of(rank: int) -> int:
    """The node index of `rank` (LOCAL_WORLD_SIZE consecutive ranks per node)."""
    return rank // local_world_size()


def node_leader(rank: int) -> bool:
    """Whether `rank` is the first rank of its node."""
    return rank % local_world_size() == 0


# -- small collectives without pickle -------------------------------------------------------------

def _send_bytes(data: bytes, dst: int) -> None:
    dist.send(torch.tensor([len(data)], dtype=torch.int64), dst)
    if data:
        dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst)


def _recv_bytes(src: int) -> bytes:
    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, src)
    buf = torch.empty(int(size.item()), dtype=torch.uint8)
    if buf.numel():
        dist.recv(buf, src)
    return buf.numpy().tobytes()


def all_gather_json(obj) -> list:
    """Every rank's JSON-able `obj`, by rank (collective over the default group)."""
    data = json.dumps(obj, sort_keys=True).encode()
    world = dist.get_world_size()
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64))
    longest = max(int(s.item()) for s in sizes)
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else mine[:0]
    bufs = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(bufs, mine)
    return [json.loads(b[:int(s.item())].numpy().tobytes()) for b, s in zip(bufs, sizes)]


# -- the transfer ---------------------------------------------------------------------------------

def _header(directory: Path, strategy: str) -> dict:
    """Rank 0: what it sends, or why it cannot."""
    manifest_path = directory / MANIFEST
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    names = files_to_send(directory, strategy)
    omitted = [n for n in (manifest.get("received") or {}).get("omitted", []) if not n.startswith("plan_report")]
    wanted = {"all": omitted, "no_weights": [n for n in omitted if n != WEIGHTS_FILE]}.get(strategy, [])
    if wanted:
        return {"error": (
            f"broadcast_strategy={strategy!r} must send {', '.join(sorted(wanted))}, but rank 0's copy in "
            f"{directory} was itself received with broadcast_strategy="
            f"{manifest['received'].get('strategy')!r} and does not hold them. Relaunch with the node "
            f"that generated the code as node rank 0, use broadcast_strategy='code' (and load the weights "
            f"from a checkpoint), or regenerate with reuse='override'.")}
    return {"files": [[n, (directory / n).stat().st_size] for n in names], "strategy": strategy}


def _receive(directory: Path, header: dict, src: int) -> Optional[str]:
    """A node leader: receive every file of `header`, write what it holds; an error as text."""
    error = None
    files = [n for n, _ in header["files"]]
    try:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / MANIFEST).unlink(missing_ok=True)  # invalid until every file is in
    except OSError as e:
        error = f"cannot write the received code into {directory}: {e}"
    manifest = None
    for name, size in header["files"]:
        chunks = []
        out = None
        for start in range(0, size, CHUNK):
            buf = torch.empty(min(CHUNK, size - start), dtype=torch.uint8)
            dist.recv(buf, src)  # always receive, even after a local error, to stay in step
            if error is not None:
                continue
            if name == MANIFEST:
                chunks.append(buf.numpy().tobytes())
                continue
            try:
                out = out or AtomicFile(directory / name)
                out.write(buf.numpy().data)
            except OSError as e:
                error = f"cannot write the received file {directory / name}: {e}"
        if error is not None:
            if out is not None:
                out.discard()
            continue
        if name == MANIFEST:
            manifest = json.loads(b"".join(chunks))
            continue
        try:
            (out or AtomicFile(directory / name)).commit()  # an empty file when nothing came
        except OSError as e:
            error = f"cannot write the received file {directory / name}: {e}"
    if error is not None:
        return error
    try:
        for path in directory.iterdir():  # older files would not match what the manifest describes
            if path.is_file() and path.name not in files:
                path.unlink()
        if manifest is not None:
            omitted = sorted(set(manifest.get("files", {})) - set(files))
            manifest["files"] = {n: m for n, m in manifest.get("files", {}).items() if n in files}
            manifest["received"] = {"strategy": header["strategy"], "omitted": omitted}
            # the manifest goes last: it makes the directory valid
            atomic_write(directory / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
    except OSError as e:
        return f"cannot write the received code into {directory}: {e}"
    return None


def broadcast_files(directory: Path, strategy: str, rank: int) -> Optional[str]:
    """Collective: send rank 0's files of `directory` to the first rank of every other node.

    Returns this rank's error as text (None when fine) instead of raising, so the caller can
    share it with every rank (runtime/driver/load_check.py) rather than leave the others waiting.
    """
    if strategy == "none" or not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    world = dist.get_world_size()
    flags = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(flags, torch.tensor([int(node_leader(rank))], dtype=torch.int64))
    leaders = [r for r in range(1, world) if flags[r].item()]
    if not leaders:
        return None  # one node: it already sees rank 0's files
    error = _transfer(directory, strategy, rank, leaders)
    dist.barrier()  # the node's other ranks read the files their leader wrote
    return error


def _transfer(directory: Path, strategy: str, rank: int, leaders: List[int]) -> Optional[str]:
    if rank == 0:
        try:
            header = _header(directory, strategy)
        except (OSError, ValueError) as e:
            header = {"error": f"rank 0 cannot read its generated code in {directory}: {e}"}
        data = json.dumps(header).encode()
        for dst in leaders:
            _send_bytes(data, dst)
        if "error" in header:
            return header["error"]
        for name, size in header["files"]:
            with open(directory / name, "rb") as f:
                for start in range(0, size, CHUNK):
                    chunk = bytearray(min(CHUNK, size - start))
                    f.readinto(chunk)
                    tensor = torch.frombuffer(chunk, dtype=torch.uint8)
                    for dst in leaders:
                        dist.send(tensor, dst)
        return None
    if rank in leaders:
        header = json.loads(_recv_bytes(0))
        if "error" in header:
            return header["error"]
        return _receive(directory, header, 0)
    return None
