"""What exact resume needs besides weights: counters, the data position, RNG states.

RNG states are kept as JSON data (lists of ints) so that they travel in a checkpoint's
``extra`` without a pickle: torch (CPU and CUDA), NumPy, Python ``random`` and the random
streams of every ParallelModule (``pm.rng_state()``), per rank.
"""
from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Any, Dict, Iterator, List, Optional

import torch

__all__ = ["TrainState", "capture_rng", "restore_rng", "SkippingSampler", "jsonable", "from_jsonable"]


@dataclass
class TrainState:
    """Counters of a run. ``epoch`` / ``idx_in_epoch`` is the next data position to read."""

    epoch: int = 0
    idx_in_epoch: int = 0  # optimizer steps already taken in `epoch`
    step: int = 0  # optimizer steps taken in total
    best_val_loss: Optional[float] = None
    last_val_loss: Optional[float] = None
    last_train_loss: Optional[float] = None

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> "TrainState":
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


def jsonable(obj: Any) -> Any:
    """Plain JSON data for a state dict: tensors become ``{"__tensor__": [...], "dtype": ...}``."""
    if isinstance(obj, torch.Tensor):
        return {"__tensor__": obj.detach().cpu().reshape(-1).tolist(), "dtype": str(obj.dtype).replace("torch.", ""),
                "shape": list(obj.shape)}
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if hasattr(obj, "tolist") and not isinstance(obj, (str, bytes)):  # numpy arrays and scalars
        return obj.tolist()
    return obj


def from_jsonable(obj: Any) -> Any:
    """The inverse of `jsonable` for tensors (lists stay lists)."""
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            t = torch.tensor(obj["__tensor__"], dtype=getattr(torch, obj["dtype"]))
            return t.reshape(obj["shape"])
        return {k: from_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [from_jsonable(v) for v in obj]
    return obj


def _parallel_modules(model: torch.nn.Module) -> List[torch.nn.Module]:
    from nnscaler.runtime import ParallelModule
    return [m for m in model.modules() if isinstance(m, ParallelModule)]


def capture_rng(model: Optional[torch.nn.Module]) -> Dict[str, Any]:
    """This rank's RNG states as JSON data."""
    state: Dict[str, Any] = {"torch": torch.get_rng_state().tolist(), "python": jsonable(random.getstate())}
    try:
        import numpy as np
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = [kind, keys.tolist(), int(pos), int(has_gauss), float(gauss)]
    except ImportError:
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    if model is not None:
        state["modules"] = [jsonable(pm.rng_state()) for pm in _parallel_modules(model)]
    return state


def restore_rng(state: Dict[str, Any], model: Optional[torch.nn.Module]) -> None:
    """Restore what `capture_rng` returned on this rank."""
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "numpy" in state:
        import numpy as np
        kind, keys, pos, has_gauss, g = state["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, g))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])
    if model is not None and "modules" in state:
        for pm, pm_state in zip(_parallel_modules(model), state["modules"]):
            pm.load_rng_state(from_jsonable(pm_state))


class SkippingSampler(torch.utils.data.Sampler):
    """Wraps a sampler; after `skip(n)` the next epoch's iteration leaves out its first n indices
    (to resume mid-epoch without reading the skipped data). `set_epoch` and `len` pass through."""

    def __init__(self, sampler):
        self.sampler = sampler
        self._skip = 0

    def skip(self, n: int) -> None:
        self._skip = n

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        skip, self._skip = self._skip, 0
        for i, index in enumerate(self.sampler):
            if i >= skip:
                yield index

    def __len__(self) -> int:
        return len(self.sampler) - self._skip
