"""`load`: the collective that fills a parallelized module (and its optimizer) of any plan and
world size from a sharded, deduped or merged checkpoint.

Each rank assembles exactly its own local tensors and optimizer pieces from the pieces the
checkpoint holds (`reshard`), reading only the bytes it needs. A deduped checkpoint loaded into the
plan and world size that saved it takes the fast path of `dedup_load`: every rank reads its own
file and receives the pieces another rank stored from that rank. RNG states are restored only when
the world size matches. Every rank raises the same error when any rank fails.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional, Union

import torch

from .checksums import verify_level
from .collectives import agree, all_gather_json, rank_and_world
from .errors import CheckpointError, describe
from .extra import join_extra
from .manifest import read_manifest
from .records import Manifest
from .dedup_load import DedupSources
from .module_tensors import LocalTensor, local_tensors, module_plans, parallel_modules, random_streams
from .optimizer_tensors import MASTER, OptimizerSlot, apply_hyper_parameters, optimizer_class, optimizer_slots
from .reshard import model_region, optimizer_region
from .rng import restore_rng, rng_keys
from .sources import Sources

__all__ = ["load"]


def _check_names(root: Path, manifest: Manifest, tensors: List[LocalTensor], complete: bool) -> None:
    """Names the module needs that the checkpoint lacks (and, when this rank holds the whole model,
    names the checkpoint has that the model lacks), listed with their shapes."""
    table = manifest.tensors
    known = set(table) | {a for t in table.values() for a in t.aliases}
    missing = [f"{lt.full_name}{list(lt.full_shape)}" for lt in tensors
               if lt.persistent and not ({lt.full_name, *lt.aliases} & known)]
    shape = [f"{lt.full_name}: {list(table[lt.full_name].shape)} in the checkpoint, {list(lt.full_shape)} in the "
             f"model" for lt in tensors if lt.full_name in table and tuple(table[lt.full_name].shape) !=
             tuple(lt.full_shape)]
    mine = {n for lt in tensors for n in (lt.full_name, *lt.aliases)}
    unexpected = sorted(n for n in table if n not in mine) if complete else []
    if missing or shape or unexpected:
        parts = ([f"missing {', '.join(missing)}"] if missing else []) + (shape if shape else []) + \
                ([f"unexpected {', '.join(unexpected)}"] if unexpected else [])
        raise CheckpointError(f"{root} was saved from another model ({'; '.join(parts)}): load a checkpoint of "
                              f"this model")


def _model_values(src: Sources, tensors: List[LocalTensor]) -> List[tuple]:
    """(local tensor, its new value) for every tensor the checkpoint holds (read, not yet set)."""
    out = []
    for lt in tensors:
        names = [lt.full_name, *lt.aliases]
        if not lt.persistent and not any(n in src.model for n in names):
            continue
        for region, tensor in lt.pieces():  # a fully sharded parameter: the blocks of its shard, in place
            if lt.value_split[0] != 0:  # the value lives in part 0, the other parts hold zeros
                out.append((tensor, torch.zeros_like(tensor, device="cpu")))
                continue
            value = model_region(src, names, lt.full_shape, region, lt.tensor.dtype)
            out.append((tensor, value.reshape(tensor.shape)))
    return out


def _slot_state(src: Sources, keys: Dict[str, List[str]], slot: OptimizerSlot) -> Dict[str, Any]:
    out = {}
    name = next((n for n in (slot.local.full_name, *slot.local.aliases) if n in keys), slot.local.full_name)
    for state in keys.get(name, []):
        recs = src.optim[(name, state)]
        if recs[0].kind == "json":
            out[state] = recs[0].value
        elif recs[0].kind == "scalar":
            out[state] = optimizer_region(src, name, state, slot.local.slices).clone()
        else:  # a copy: the optimizer keeps it, it must not hold on to a file buffer
            dense = optimizer_region(src, name, state, slot.local.slices)
            out[state] = dense.reshape(-1)[slot.start:slot.stop].clone() if slot.flat \
                else dense.reshape(slot.local.tensor.shape).clone()
    return out


def _optimizer_state(src: Sources, manifest: Manifest, module, optimizer, tensors) -> Dict[str, Any]:
    """The state dict to give `optimizer.load_state_dict` (read, not yet set)."""
    saved = manifest.optimizer
    if saved is None:
        raise CheckpointError(f"{src.root} holds no optimizer state (saved without an optimizer): call load without "
                              f"one, or load a checkpoint saved with it")
    if saved.cls != optimizer_class(optimizer):
        raise CheckpointError(f"{src.root} holds the state of a {saved.cls}, this optimizer is a "
                              f"{optimizer_class(optimizer)}: build the same optimizer, or load the model only")
    keys: Dict[str, List[str]] = {}
    for name, state in src.optim:
        keys.setdefault(name, []).append(state)
    state, masters = {}, {}
    for slot in optimizer_slots(module, optimizer, tensors):
        values = _slot_state(src, keys, slot)
        if MASTER in values:
            masters[slot.index] = values.pop(MASTER)
        if values:
            state[slot.index] = values
    current = optimizer.state_dict()
    new = {"state": state, "param_groups": apply_hyper_parameters(current["param_groups"], saved.param_groups)}
    if MASTER in current:
        new[MASTER] = masters
    return new


def _raise_if_any(error: Optional[str]) -> None:
    """Every rank raises the first error any rank met (collective: one all-reduce when none did)."""
    if agree(error is None):
        return
    errors = all_gather_json(error)
    raise CheckpointError(next(e for e in errors if e))


def load(path, module: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *,
         verify: Union[str, bool] = "fast") -> Any:
    """Load checkpoint directory `path` into `module` (and `optimizer`); returns the ``extra``
    saved by this rank (by rank 0 when the world size differs). COLLECTIVE. Each file read is
    checked first at level `verify` (`checksums`): ``"fast"`` (size and chunked CRC-32, the
    SHA-256 for manifests without it), ``"sha256"`` (or True) or ``"size"`` (or False). Nothing
    changes unless every rank succeeds."""
    rank, world = rank_and_world()
    root = Path(path).absolute()
    verify = verify_level(verify)
    error, manifest, tensors = None, None, None
    try:
        manifest = read_manifest(root)
        tensors = local_tensors(module)
        complete = all(lt.slices == tuple((0, d) for d in lt.full_shape) for lt in tensors) and \
            not any(pm.PIPELINE is not None for _, pm in parallel_modules(module))
        _check_names(root, manifest, tensors, complete)
    except Exception as e:  # noqa: BLE001 - every rank must learn of it, or the others wait forever
        error = describe(e, rank)
    _raise_if_any(error)
    same_world = manifest.world_size == world
    if manifest.kind == "deduped" and same_world and manifest.plan == module_plans(module):
        source = DedupSources(root, manifest, verify, rank, tensors)  # collective
    else:
        # on the same world size this rank's own file is read at once; not where the module holds shards
        # (use_zero=3): each piece is read into its own tensor then, so what a load adds is about the
        # shards' size (the whole file kept besides the optimizer state's copies would be more)
        ranks = manifest.ranks
        held = any(lt.held is not None for lt in tensors)
        own = [ranks[rank].file] if same_world and manifest.kind != "merged" and rank < len(ranks) and not held \
            else []
        source = Sources(root, manifest, verify, prefer_rank=rank if same_world else None, whole_files=own)
    result, restore, new_state, values = None, None, None, []
    try:
        with source as src:
            values = _model_values(src, tensors)
            new_state = None if optimizer is None else _optimizer_state(src, manifest, module, optimizer, tensors)
            ranks = manifest.ranks
            mine = rank if same_world and rank < len(ranks) else 0
            if ranks:
                file, prefix = ranks[mine].file, ranks[mine].prefix or ""
                read = lambda key: src.read_key(file, prefix + key).clone()  # noqa: E731
                if same_world and ranks[mine].rng:
                    info = ranks[mine].rng
                    restore = (info, {k: read(k) for k in rng_keys(info)})
                result = join_extra(ranks[mine].extra, read)
    except Exception as e:  # noqa: BLE001 - every rank must learn of it, or the others wait forever
        error = describe(e, rank)
    _raise_if_any(error)  # nothing was changed yet
    with torch.no_grad():
        for tensor, value in values:
            tensor.copy_(value)
    if new_state is not None:
        optimizer.load_state_dict(new_state)
    if restore is not None:
        restore_rng(restore[0], restore[1].__getitem__, random_streams(module))
    return result
