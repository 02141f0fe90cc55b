"""Filling a ParallelModule's local tensors from full (single-device) weights: the initial
weights saved beside the generated code (`WEIGHTS_FILE`), or a state dict the user passes."""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Dict, List, Mapping, Tuple

import torch

from nnscaler.ir.contracts import FullMapEntry
from nnscaler.ir.contracts import WEIGHTS_FILE

from .errors import PlanMismatchError
from .source_notes import generated_file

__all__ = ["WeightLoadingMixin"]


class WeightLoadingMixin:
    """`load_full_state` and the initial weights of a ParallelModule (mixed into it)."""

    def load_initial_weights(self) -> None:
        """Load the full initial weights written beside the generated code (each rank reads only
        its slices)."""
        generated = generated_file(type(self))
        path = Path(generated).parent / WEIGHTS_FILE if generated else Path(WEIGHTS_FILE)
        if not generated or not path.is_file():
            raise FileNotFoundError(
                f"{type(self).__name__}: initial weights {path} not found: regenerate the code, or build "
                f"the module with init_params=False and call load_full_state(state_dict)")
        from safetensors import safe_open
        with safe_open(str(path), framework="pt") as f:
            names = set(f.keys())

            def read(name: str, entry: FullMapEntry) -> torch.Tensor:
                if entry.is_whole:
                    return f.get_tensor(name)
                return f.get_slice(name)[tuple(slice(a, b) for a, b in entry.slices)]

            self._load_full(names, lambda name: tuple(f.get_slice(name).get_shape()), read, str(path), True)

    def load_full_state(self, tensors: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        """Fill every local tensor from FULL tensors by original (single-device) name.

        Missing names (a full name and all its aliases absent; non-persistent buffers are
        optional) and unexpected names raise PlanMismatchError when `strict`; unexpected means
        "not a tensor of the model", checked when this rank holds the whole model
        (plan_ngpus == 1). Shape mismatches always raise."""
        def read(name: str, entry: FullMapEntry) -> torch.Tensor:
            return tensors[name][tuple(slice(a, b) for a, b in entry.slices)]

        self._load_full(set(tensors), lambda name: tuple(tensors[name].shape), read, "the given state", strict)

    def _load_full(self, names: set, shape_of: Callable[[str], Tuple[int, ...]],
                   read: Callable[[str, FullMapEntry], torch.Tensor], origin: str, strict: bool) -> None:
        aliases: Dict[str, List[str]] = {}
        for full, local in self.full_aliases.items():
            aliases.setdefault(local, []).append(full)
        todo, missing, known = [], [], set(self.full_aliases)
        for local, entry in self.fullmap.items():
            known.add(entry.full_name)
            tensor, required = self.local_tensor(local)
            source = next((n for n in [entry.full_name, *aliases.get(local, [])] if n in names), None)
            if source is None:
                if required:
                    missing.append(entry.full_name)
                continue
            if shape_of(source) != entry.full_shape:
                raise PlanMismatchError(f"{source!r} in {origin} has shape {shape_of(source)}, the model "
                                        f"expects {entry.full_shape}")
            todo.append((tensor, entry, source))
        unexpected = sorted(names - known) if self.grid.plan_ngpus == 1 else []
        if strict and (missing or unexpected):
            raise PlanMismatchError(
                f"{origin} does not match the model:"
                + (f" missing {', '.join(missing)};" if missing else "")
                + (f" unexpected {', '.join(unexpected)};" if unexpected else "")
                + " pass the single-device model's state_dict (or strict=False to skip).")
        with torch.no_grad():
            for tensor, entry, source in todo:
                if entry.value_split[0] != 0:  # piece 0 holds the value, the others zeros
                    tensor.zero_()
                else:
                    tensor.copy_(read(source, entry))
