"""The public record of how ZeRO shards optimizer state (`opt.zero_layout`).

Written by the runtime's ZeRO layer, read by the checkpoint package to merge or reshard optimizer
state without importing the runtime: plain dataclasses, `to_dict()` gives JSON and `from_dict()` reads it back.
Versioned by `LAYOUT_VERSION`. See `ZeroShardLayout` for how to put the state back together.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Mapping, Tuple

LAYOUT_VERSION = 1

__all__ = ["LAYOUT_VERSION", "ZeroBucket", "ZeroGeometry", "ZeroPiece", "ZeroShardLayout"]


@dataclass(frozen=True)
class ZeroGeometry:
    """Which ranks share one rank's optimizer state (the runtime's zero groups and the layout
    record both are this geometry).

    rank, world_size, plan_ngpus, dp_size: the run. group_ranks: the zero group (global ranks,
    ascending), the ranks that together hold one copy of the optimizer state of this plan device's
    tensors; group_index: this rank's index in it (= the shard it owns in every bucket); ngroups:
    zero_ngroups; group_id: which of the ngroups zero groups of this plan device this one is;
    cross_ranks: the ranks holding the same shard index in every zero group of this plan device
    (this rank included)."""

    rank: int
    world_size: int
    plan_ngpus: int
    dp_size: int
    ngroups: int
    group_ranks: Tuple[int, ...]
    group_index: int
    group_id: int
    cross_ranks: Tuple[int, ...]

    @property
    def group_size(self) -> int:
        return len(self.group_ranks)


# -- public metadata --------------------------------------------------------------------------------
@dataclass(frozen=True)
class ZeroPiece:
    """One owned piece: elements ``[start, stop)`` of the flattened (row-major) LOCAL tensor
    ``local_name``, whose optimizer state is optimizer parameter ``state_index``.

    module_path: where the tensor's ParallelModule sits in the module given to build_optimizer
        ("" for that module itself); "" too for a plain parameter (``parallel`` False).
    parallel: True for a ParallelModule tensor, False for a plain (replicated) parameter.
    local_name: the parameter's name in its ParallelModule (a key of ``pm.fullmap``), or the
        plain parameter's name in the module given to build_optimizer.
    full_name, full_shape, slices, value_split, replicas: the tensor's `FullMapEntry` (where the
        local tensor sits in the full single-device tensor); for a plain parameter its own name
        and shape, whole slices, ``(0, 1)`` and ``replicas = plan_ngpus``.
    local_shape: shape of the local tensor.
    start, stop: the owned range of the flattened local tensor.
    state_index: index of the optimizer parameter (key of ``opt.state_dict()["state"]``).
    bucket: index into ``ZeroShardLayout.buckets``; bucket_offset: position of element ``start``
        in that bucket's flat buffer (``bucket_offset - group_index * shard_numel`` is its
        position in this rank's shard).
    """

    state_index: int
    module_path: str
    parallel: bool
    local_name: str
    full_name: str
    full_shape: Tuple[int, ...]
    slices: Tuple[Tuple[int, int], ...]
    value_split: Tuple[int, int]
    replicas: int
    local_shape: Tuple[int, ...]
    start: int
    stop: int
    bucket: int
    bucket_offset: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class ZeroBucket:
    """One flat bucket, identical on every rank of the zero group.

    numel: real elements; padded_numel: numel rounded up to a multiple of the group size;
    shard_numel = padded_numel // group size (each rank owns that many, padding included);
    dtype: the tensors' dtype (e.g. "float32"); reduce_scatter: whether the ZeRO layer reduces
    the bucket's gradients (True) or they arrive averaged (False);
    tensors: ``(module_path, local_name, offset, numel)`` of every tensor in the bucket, in order.
    """

    numel: int
    padded_numel: int
    shard_numel: int
    dtype: str
    reduce_scatter: bool
    tensors: Tuple[Tuple[str, str, int, int], ...]

    @property
    def padding(self) -> int:
        return self.padded_numel - self.numel


@dataclass(frozen=True)
class ZeroShardLayout(ZeroGeometry):
    """How the optimizer state of one rank is sharded (ZeRO stage 1). Public, versioned.

    The `ZeroGeometry` fields (rank ... cross_ranks), then: version: LAYOUT_VERSION.
    reduce_scatter: whether gradients of ParallelModule tensors are reduce-scattered by ZeRO
        (zero_use_reduce_scatter with more than one data-parallel replica).
    buckets: the flat buckets (`ZeroBucket`); pieces: the owned pieces (`ZeroPiece`), in
        bucket order.

    Putting the state together: for each rank's layout and each piece, every state tensor of
    ``opt.state_dict()["state"][piece.state_index]`` (and the fp32 master
    ``state_dict()["master_weights"][piece.state_index]`` under precision's
    ``with_master_weights``) holds elements ``piece.start:piece.stop`` of the flattened
    (row-major) local tensor, which is ``slices`` of the full tensor ``full_name`` (prefixed with
    ``module_path + "."`` when the ParallelModule is a sub-module). Over the ranks of one zero
    group the pieces of a local tensor cover each of its elements exactly once; the other zero
    groups, tensor-parallel replicas (``replicas > 1``) and, for plain parameters, the other plan
    devices hold identical copies.
    """

    version: int
    reduce_scatter: bool
    buckets: Tuple[ZeroBucket, ...]
    pieces: Tuple[ZeroPiece, ...]

    @property
    def flat_numel(self) -> int:
        """Real elements over all buckets."""
        return sum(b.numel for b in self.buckets)

    @property
    def padded_numel(self) -> int:
        return sum(b.padded_numel for b in self.buckets)

    @property
    def padding(self) -> int:
        return self.padded_numel - self.flat_numel

    @property
    def shard_numel(self) -> int:
        """Elements this rank owns, padding included."""
        return sum(b.shard_numel for b in self.buckets)

    def to_dict(self) -> Dict[str, Any]:
        """JSON-able dict (tuples become lists)."""
        out = {k: getattr(self, k) for k in ("version", "rank", "world_size", "plan_ngpus", "dp_size", "ngroups",
                                             "group_index", "group_id", "reduce_scatter")}
        out["group_ranks"] = list(self.group_ranks)
        out["cross_ranks"] = list(self.cross_ranks)
        out["buckets"] = [dict(numel=b.numel, padded_numel=b.padded_numel, shard_numel=b.shard_numel,
                               dtype=b.dtype, reduce_scatter=b.reduce_scatter,
                               tensors=[list(t) for t in b.tensors]) for b in self.buckets]
        out["pieces"] = [dict(state_index=p.state_index, module_path=p.module_path, parallel=p.parallel,
                              local_name=p.local_name, full_name=p.full_name, full_shape=list(p.full_shape),
                              slices=[list(s) for s in p.slices], value_split=list(p.value_split),
                              replicas=p.replicas, local_shape=list(p.local_shape), start=p.start, stop=p.stop,
                              bucket=p.bucket, bucket_offset=p.bucket_offset) for p in self.pieces]
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ZeroShardLayout":
        if data.get("version") != LAYOUT_VERSION:
            raise ValueError(f"ZeRO layout version {data.get('version')!r} is not supported (expected {LAYOUT_VERSION})")
        buckets = tuple(ZeroBucket(b["numel"], b["padded_numel"], b["shard_numel"], b["dtype"], b["reduce_scatter"],
                                   tuple((str(m), str(n), int(o), int(k)) for m, n, o, k in b["tensors"]))
                        for b in data["buckets"])
        pieces = tuple(ZeroPiece(p["state_index"], p["module_path"], p["parallel"], p["local_name"], p["full_name"],
                                 tuple(p["full_shape"]), tuple(tuple(s) for s in p["slices"]),
                                 tuple(p["value_split"]), p["replicas"], tuple(p["local_shape"]), p["start"],
                                 p["stop"], p["bucket"], p["bucket_offset"]) for p in data["pieces"])
        return cls(data["rank"], data["world_size"], data["plan_ngpus"], data["dp_size"], data["ngroups"],
                   tuple(data["group_ranks"]), data["group_index"], data["group_id"], tuple(data["cross_ranks"]),
                   version=data["version"], reduce_scatter=data["reduce_scatter"], buckets=buckets, pieces=pieces)


