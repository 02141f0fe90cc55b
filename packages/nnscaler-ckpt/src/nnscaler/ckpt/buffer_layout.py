"""Where each tensor of a rank's file sits in the shared buffer of `async_save`: the caller copies
its tensors in (`copy_into`), the background process writes them out from views of the same bytes
(`views`). Both sides compute the places from the plan's tensor specs alone (key, dtype, shape, in
file order), each tensor at a multiple of 64 bytes."""
from __future__ import annotations

import math
from typing import List, Sequence, Tuple

import torch

__all__ = ["Spec", "spec_of", "offsets", "nbytes", "copy_into", "views"]

Spec = Tuple[str, str, Tuple[int, ...]]  # (key, torch dtype name such as "float32", shape)
_ALIGN = 64


def spec_of(key: str, t: torch.Tensor) -> Spec:
    return key, str(t.dtype).replace("torch.", ""), tuple(t.shape)


def _size(spec: Spec) -> int:
    return math.prod(spec[2]) * torch.empty((), dtype=getattr(torch, spec[1])).element_size()


def offsets(specs: Sequence[Spec]) -> Tuple[List[int], int]:
    """(the byte offset of every tensor, the bytes of the whole buffer)."""
    out, at = [], 0
    for spec in specs:
        out.append(at)
        at += -(-_size(spec) // _ALIGN) * _ALIGN
    return out, at


def nbytes(specs: Sequence[Spec]) -> int:
    return offsets(specs)[1]


def copy_into(buffer: torch.Tensor, tensors: Sequence[Tuple[str, torch.Tensor]]) -> None:
    """Copy `tensors` (key, tensor) into `buffer` at their places; synchronized when any lives on CUDA."""
    cuda = False
    with torch.no_grad():
        for (key, t), offset in zip(tensors, offsets([spec_of(k, v) for k, v in tensors])[0]):
            n = t.numel() * t.element_size()
            if n:
                buffer[offset:offset + n].view(t.dtype).reshape(t.shape).copy_(t.detach(), non_blocking=t.is_cuda)
                cuda = cuda or t.is_cuda
    if cuda:
        torch.cuda.synchronize()


def views(buffer: torch.Tensor, specs: Sequence[Spec]) -> List[Tuple[str, torch.Tensor]]:
    """(key, tensor) of every spec, as views of `buffer` (no copy)."""
    out = []
    for (key, dtype, shape), offset in zip(specs, offsets(specs)[0]):
        dt = getattr(torch, dtype)
        n = _size((key, dtype, shape))
        out.append((key, buffer[offset:offset + n].view(dt).reshape(shape) if n else torch.empty(shape, dtype=dt)))
    return out
