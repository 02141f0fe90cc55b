"""One rank's share of a checkpoint: the tensors it writes and the manifest records describing
them (model pieces, optimizer-state pieces, RNG states, the caller's extra)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from .extra import split_extra
from .module_tensors import LocalTensor, local_tensors, piece_key, random_streams
from .optimizer_tensors import MASTER, element_wise, optimizer_slots, state_of, with_first_step_state
from .records import ModelPiece, OptimizerPiece, TensorInfo
from .rng import capture_rng

__all__ = ["RankState", "RankShare", "collect", "keep_only", "share_of"]


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


@dataclass
class RankState:
    tensors: List[Tuple[str, torch.Tensor]] = field(default_factory=list)
    model: List[ModelPiece] = field(default_factory=list)
    optimizer_state: List[OptimizerPiece] = field(default_factory=list)
    rng: Dict[str, Any] = field(default_factory=dict)
    extra: Any = None
    locals: List[LocalTensor] = field(default_factory=list)
    # every persistent full tensor the rank holds a part of, in its local order: the manifest's
    # `tensors` (and a merge's file) keep the order of the local tensors whichever rank stores
    # which shard of them
    infos: List[Tuple[str, TensorInfo]] = field(default_factory=list)


def _unique(key: str, used: set) -> str:
    out, i = key, 1
    while out in used:
        out, i = f"{key}#{i}", i + 1
    used.add(out)
    return out


def collect(module: torch.nn.Module, optimizer, extra: Any, rank: int, *, first_step: bool = False) -> RankState:
    """Describe (and reference, without copying) everything this rank saves: the model's pieces as
    held (a fully sharded parameter: the blocks of this rank's shard ranges, never gathered). `first_step`: an
    optimizer parameter without state yet is described with the state its first step will give
    it (``meta`` tensors, `with_first_step_state`): what a save after that step holds, for sizing
    only (`async_save.prepare_async_save`)."""
    st = RankState()
    used: set = set()
    st.locals = local_tensors(module)
    for lt in st.locals:
        if not lt.persistent:
            continue
        st.infos.append((lt.full_name, TensorInfo(tuple(lt.full_shape), _dtype(lt.tensor), list(lt.aliases))))
        for slices, tensor in lt.pieces():  # the whole local tensor, or the blocks of its held shard ranges
            key = _unique(f"model/{lt.full_name}", used)
            st.tensors.append((key, tensor))
            st.model.append(ModelPiece(key=key, rank=rank, full_name=lt.full_name, full_shape=tuple(lt.full_shape),
                                       slices=tuple(slices), value_split=tuple(lt.value_split), replicas=lt.replicas,
                                       aliases=list(lt.aliases), dtype=_dtype(tensor), shape=tuple(tensor.shape),
                                       piece=piece_key(lt.full_name, slices, lt.value_split)))
    if optimizer is not None:
        states, masters = state_of(optimizer)
        if first_step:
            states = with_first_step_state(optimizer, states)
        for slot in optimizer_slots(module, optimizer, st.locals):
            values = dict(states.get(slot.index, {}))
            if masters is not None and slot.index in masters:
                values[MASTER] = masters[slot.index]
            lt = slot.local
            for name, value in values.items():
                base = dict(rank=rank, full_name=lt.full_name, state=name, full_shape=tuple(lt.full_shape),
                            slices=tuple(lt.slices), start=slot.start, stop=slot.stop)
                if not isinstance(value, torch.Tensor):
                    st.optimizer_state.append(OptimizerPiece(**base, kind="json", value=value))
                    continue
                kind = ("flat" if slot.flat else "local") if element_wise(value, slot) else "scalar"
                key = _unique(f"optim/{lt.full_name}/{name}", used)
                st.tensors.append((key, value))
                st.optimizer_state.append(OptimizerPiece(**base, kind=kind, key=key, dtype=_dtype(value),
                                                         shape=tuple(value.shape)))
    rng_tensors, st.rng = capture_rng(random_streams(module))
    st.tensors.extend(rng_tensors.items())
    st.extra, extra_tensors = split_extra(extra)
    st.tensors.extend(extra_tensors.items())
    return st


def keep_only(st: RankState, model_ids: Optional[set], optim_ids: Optional[set]) -> None:
    """Drop the pieces another rank stores (deduped)."""
    if model_ids is not None:
        st.model = [r for r in st.model if r.piece in model_ids]
    if optim_ids is not None:
        st.optimizer_state = [r for r in st.optimizer_state if r.piece_id in optim_ids]
    keys = {r.key for r in st.model} | {r.key for r in st.optimizer_state}
    st.tensors = [(k, t) for k, t in st.tensors if k in keys or not k.startswith(("model/", "optim/"))]


@dataclass
class RankShare:
    """The manifest records of one rank's share (its RankState without the tensors), as ranks
    send them to rank 0 (JSON on the wire)."""

    file: str
    model: List[ModelPiece]
    optimizer_state: List[OptimizerPiece]
    rng: Dict[str, Any]
    extra: Any
    tensors: List[Tuple[str, TensorInfo]] = field(default_factory=list)

    def to_json(self) -> Dict[str, Any]:
        return {"file": self.file, "model": [r.to_json() for r in self.model],
                "optimizer_state": [r.to_json() for r in self.optimizer_state], "rng": self.rng, "extra": self.extra,
                "tensors": [[n, t.to_json()] for n, t in self.tensors]}

    @classmethod
    def from_json(cls, data: Dict[str, Any]) -> "RankShare":
        return cls(data["file"], [ModelPiece.from_json(r, "model") for r in data["model"]],
                   [OptimizerPiece.from_json(r, "optimizer_state") for r in data["optimizer_state"]], data["rng"],
                   data["extra"], [(n, TensorInfo.from_json(t, n)) for n, t in data.get("tensors", [])])


def share_of(st: RankState, file: str) -> RankShare:
    return RankShare(file, st.model, st.optimizer_state, st.rng, st.extra, st.infos)
