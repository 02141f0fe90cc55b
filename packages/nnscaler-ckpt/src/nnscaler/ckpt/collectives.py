"""The few collectives save and load need, over the default process group, carrying JSON as
bytes (never a pickle, unlike ``all_gather_object``). Without a process group (or with one rank)
they are trivial, so save and load also work in a plain single process."""
from __future__ import annotations

import json
from typing import Any, List

import torch
import torch.distributed as dist

__all__ = ["rank_and_world", "distributed", "all_gather_json", "broadcast_json", "agree", "barrier"]


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank_and_world():
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _device() -> torch.device:
    """Where collectives need their tensors (CUDA for NCCL, CPU for gloo)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_json(obj: Any) -> List[Any]:
    """Every rank's `obj` (JSON-able), by rank."""
    if not distributed():
        return [json.loads(json.dumps(obj))]
    dev = _device()
    data = torch.frombuffer(bytearray(json.dumps(obj).encode("utf-8")), dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=dev)
    sizes = [torch.zeros_like(size) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, size)
    longest = int(max(s.item() for s in sizes))
    buf = torch.zeros(longest, dtype=torch.uint8, device=dev)
    buf[:data.numel()] = data.to(dev)
    out = [torch.empty_like(buf) for _ in sizes]
    dist.all_gather(out, buf)
    return [json.loads(bytes(o[:int(s.item())].cpu().numpy()).decode("utf-8")) for o, s in zip(out, sizes)]


def broadcast_json(obj: Any, src: int = 0) -> Any:
    """Rank `src`'s `obj` on every rank."""
    if not distributed():
        return obj
    return all_gather_json(obj if dist.get_rank() == src else None)[src]


def agree(ok: bool) -> bool:
    """True on every rank when `ok` is True on every rank."""
    if not distributed():
        return ok
    flag = torch.tensor([0 if ok else 1], dtype=torch.int32, device=_device())
    dist.all_reduce(flag)
    return int(flag.item()) == 0


def barrier() -> None:
    if distributed():
        agree(True)
