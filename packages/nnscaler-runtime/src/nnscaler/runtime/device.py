"""Which device and backend this process uses."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

__all__ = ["default_device", "default_backend", "is_distributed"]


def default_device() -> torch.device:
    """`cuda:LOCAL_RANK` when CUDA is available (LOCAL_RANK defaults to 0), else `cpu`."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def default_backend() -> str:
    """The torch.distributed backend matching `default_device()`: nccl with CUDA, gloo on CPU."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def is_distributed() -> bool:
    """Whether torch.distributed is available and its default process group is initialized."""
    return dist.is_available() and dist.is_initialized()
