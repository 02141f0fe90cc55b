"""Random-number states of one rank as plain tensors and JSON: torch CPU, every CUDA device,
NumPy's global generator, Python's ``random``, and each parallelized module's own stream
(``pm.rng_state()``). Restored only where the saving rank's world size matches.

`rng_snapshot` / `restore_rng_snapshot` hold the same states in memory, e.g. to set them again
right before training starts after a ``load``."""
from __future__ import annotations

import random
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

from .module_tensors import random_streams

__all__ = ["capture_rng", "restore_rng", "rng_keys", "rng_snapshot", "restore_rng_snapshot", "PREFIX"]

PREFIX = "rng/"


def capture_rng(streams: Dict[str, Any]) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """(tensors keyed ``rng/...``, JSON) of this process's RNG states; `streams`: module path ->
    a module with ``rng_state()``."""
    tensors = {f"{PREFIX}torch": torch.get_rng_state()}
    info: Dict[str, Any] = {"cuda": 0, "modules": {}}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states = torch.cuda.get_rng_state_all()
        info["cuda"] = len(states)
        for i, s in enumerate(states):
            tensors[f"{PREFIX}cuda/{i}"] = s
    version, state, gauss = random.getstate()
    info["python"] = {"version": version, "state": list(state), "gauss": gauss}
    name, keys, pos, has_gauss, cached = np.random.get_state()
    tensors[f"{PREFIX}numpy"] = torch.from_numpy(keys.astype("int64"))
    info["numpy"] = {"name": name, "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)}
    for path, module in streams.items():
        keys = []
        for key, value in module.rng_state().items():
            tensors[f"{PREFIX}module/{path}/{key}"] = value.detach().cpu()
            keys.append(key)
        info["modules"][path] = keys
    return tensors, info


def restore_rng(info: Dict[str, Any], read: Callable[[str], torch.Tensor], streams: Dict[str, Any]) -> None:
    """Set the states `capture_rng` recorded; `read(key)` returns a saved tensor."""
    torch.set_rng_state(read(f"{PREFIX}torch"))
    if info.get("cuda") and torch.cuda.is_available():
        n = min(int(info["cuda"]), torch.cuda.device_count())
        torch.cuda.set_rng_state_all([read(f"{PREFIX}cuda/{i}") for i in range(n)])
    py = info.get("python")
    if py:
        random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
    if info.get("numpy"):
        n = info["numpy"]
        np.random.set_state((n["name"], read(f"{PREFIX}numpy").numpy().astype("uint32"), n["pos"],
                             n["has_gauss"], n["cached"]))
    for path, keys in info.get("modules", {}).items():
        if path in streams:
            streams[path].load_rng_state({k: read(f"{PREFIX}module/{path}/{k}") for k in keys})


def rng_keys(info: Dict[str, Any]) -> List[str]:
    """The tensor keys `capture_rng` stored for `info`."""
    keys = [f"{PREFIX}torch"] + [f"{PREFIX}cuda/{i}" for i in range(int(info.get("cuda") or 0))]
    if info.get("numpy"):
        keys.append(f"{PREFIX}numpy")
    keys += [f"{PREFIX}module/{p}/{k}" for p, ks in info.get("modules", {}).items() for k in ks]
    return keys


def rng_snapshot(module: Optional[torch.nn.Module]) -> Tuple[Dict[str, Any], Dict[str, torch.Tensor]]:
    """(JSON, tensors) of this process's RNG states now, those of `module`'s parallelized modules
    included; `restore_rng_snapshot` sets them again."""
    tensors, info = capture_rng(random_streams(module))
    return info, {k: v.clone() for k, v in tensors.items()}


def restore_rng_snapshot(snapshot: Tuple[Dict[str, Any], Dict[str, torch.Tensor]],
                         module: Optional[torch.nn.Module]) -> None:
    """Set the states `rng_snapshot` took."""
    info, tensors = snapshot
    restore_rng(info, tensors.__getitem__, random_streams(module))
