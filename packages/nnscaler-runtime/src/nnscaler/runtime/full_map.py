"""Where each of a ParallelModule's local tensors sits in the full (single-device) model.

The generated ``__init__`` records it with `add_full_map` (and `add_full_alias` for tied
weights); weight loading, the optimizer, ZeRO and the checkpoint package read `fullmap`
(local name -> `nnscaler.ir.contracts.FullMapEntry`).
"""
from __future__ import annotations

import types
from typing import Dict, Mapping, Sequence, Tuple

import torch

from nnscaler.ir.contracts import FullMapEntry

from .errors import GenerationError

__all__ = ["FullMapMixin"]


class FullMapMixin:
    """The full map of a ParallelModule (mixed into it; call `_init_full_map` in __init__)."""

    def _init_full_map(self) -> None:
        self._fullmap: Dict[str, FullMapEntry] = {}
        self._full_aliases: Dict[str, str] = {}

    @property
    def fullmap(self) -> Mapping[str, FullMapEntry]:
        """local name -> FullMapEntry (read-only)."""
        return types.MappingProxyType(self._fullmap)

    @property
    def full_aliases(self) -> Mapping[str, str]:
        """Extra full name -> local name, for tied parameters (read-only)."""
        return types.MappingProxyType(self._full_aliases)

    def add_full_map(self, local_name: str, full_name: str, full_shape: Sequence[int],
                     slices: Sequence[Sequence[int]], value_split: Sequence[int] = (0, 1),
                     replicas: int = 1) -> None:
        """Record that local tensor `local_name` is `slices` of full tensor `full_name`."""
        tensor, _ = self.local_tensor(local_name)
        entry = FullMapEntry(local_name, full_name, tuple(int(d) for d in full_shape),
                             tuple((int(a), int(b)) for a, b in slices),
                             tuple(int(v) for v in value_split), int(replicas))
        problem = None
        if len(entry.slices) != len(entry.full_shape):
            problem = f"{len(entry.slices)} slices for a {len(entry.full_shape)}-d tensor"
        elif any(not 0 <= a <= b <= d for (a, b), d in zip(entry.slices, entry.full_shape)):
            problem = f"slices {entry.slices} outside full shape {entry.full_shape}"
        elif entry.local_shape != tuple(tensor.shape):
            problem = f"slices {entry.slices} give shape {entry.local_shape}, the tensor has {tuple(tensor.shape)}"
        elif len(entry.value_split) != 2 or not 0 <= entry.value_split[0] < entry.value_split[1]:
            problem = f"value_split {entry.value_split} is not (i, n) with 0 <= i < n"
        elif entry.replicas < 1:
            problem = f"replicas {entry.replicas} < 1"
        if problem:
            raise GenerationError(f"{type(self).__name__}.add_full_map({local_name!r} -> {full_name!r}): {problem}")
        self._fullmap[local_name] = entry

    def add_full_alias(self, full_name: str, local_name: str) -> None:
        """Declare that full tensor `full_name` is the same (tied) tensor as `local_name`."""
        if local_name not in self._fullmap:
            raise GenerationError(f"{type(self).__name__}.add_full_alias({full_name!r}, {local_name!r}): "
                                  f"call add_full_map({local_name!r}, ...) first")
        self._full_aliases[full_name] = local_name

    def local_tensor(self, local_name: str) -> Tuple[torch.Tensor, bool]:
        """(tensor, required) of a local name; required is False only for non-persistent buffers."""
        path, _, attr = local_name.rpartition(".")
        module = self.get_submodule(path) if path else self
        if attr in module._parameters and module._parameters[attr] is not None:
            return module._parameters[attr], True
        if attr in module._buffers and module._buffers[attr] is not None:
            return module._buffers[attr], attr not in module._non_persistent_buffers_set
        raise GenerationError(f"{type(self).__name__} has no parameter or buffer {local_name!r}")

    def unmapped_tensors(self) -> list:
        """Parameters and persistent buffers the generated code registered without add_full_map."""
        names = [n for n, _ in self.named_parameters()] + [
            f"{m}.{b}".lstrip(".") for m, mod in self.named_modules() for b in mod._buffers
            if mod._buffers[b] is not None and b not in mod._non_persistent_buffers_set]
        return [n for n in names if n not in self._fullmap]
