"""Which collectives a backend runs natively, and the fallback used where it does not.

Chosen per call from ``(dist.get_backend(group), tensor.device.type)``:

================  =============================  ==============================================
collective        native call                    fallback (same result, more traffic/memory)
================  =============================  ==============================================
all_gather        ``all_gather_single``          list ``dist.all_gather`` into n tensors + stack
                  (``all_gather_into_tensor``)
reduce_scatter    ``reduce_scatter_single``      ``all_reduce`` of the whole tensor, keep own
                  (``reduce_scatter_tensor``)    slice (payload B instead of B, wire 2x)
all_to_all        ``all_to_all_single``          ``all_gather`` along the source dim, keep own
                                                 slice of the destination dim (wire n x)
all_reduce        ``all_reduce`` (sum)           always native
================  =============================  ==============================================

Measured on torch 2.13 (CPU): gloo runs all four natively for float32/64, float16, bfloat16 and
int64 tensors, in the default group and in sub-groups. The gloo gaps of torch 2.13 are uneven
all-gather (nnscaler only splits evenly, so it never needs it) and ``PREMUL_SUM`` (never used:
everything here is a plain sum). gloo with CUDA tensors is not measured here and takes the
fallbacks (its CUDA path is the all-reduce / list all-gather one); NCCL runs everything
natively; an unknown backend takes the fallbacks, which need only ``all_reduce`` and list
``all_gather``.

A fallback is counted in the stats as ``<name>(fallback)``. `force_fallback(...)` (or the
environment variable ``NNSCALER_COMM_FALLBACK=reduce_scatter,all_to_all`` / ``all``) forces
fallbacks, to test them or to work around a backend bug; it must be set alike on every rank.
"""
from __future__ import annotations

import contextlib
import os
from typing import Dict, FrozenSet, Iterator, Tuple

__all__ = ["COLLECTIVES", "NATIVE", "FALLBACK_OF", "uses_fallback", "fallback_plan", "force_fallback"]

COLLECTIVES: Tuple[str, ...] = ("all_gather", "reduce_scatter", "all_to_all")

_ALL = frozenset(COLLECTIVES)
# (backend, device type) -> collectives run natively; "*" = any device type.
NATIVE: Dict[Tuple[str, str], FrozenSet[str]] = {
    ("gloo", "cpu"): _ALL,
    ("gloo", "*"): frozenset(),
    ("nccl", "*"): _ALL,
    ("cpu:gloo,cuda:nccl", "cpu"): _ALL,
    ("cpu:gloo,cuda:nccl", "cuda"): _ALL,
}

FALLBACK_OF: Dict[str, str] = {
    "all_gather": "list all_gather into n tensors, then stack",
    "reduce_scatter": "all_reduce of the whole tensor, then keep this rank's slice",
    "all_to_all": "all_gather along the source dim, then keep this rank's slice of the destination dim",
}

_FORCED: FrozenSet[str] = frozenset()


def _env_forced() -> FrozenSet[str]:
    text = os.environ.get("NNSCALER_COMM_FALLBACK", "").strip()
    if not text:
        return frozenset()
    names = {t.strip() for t in text.split(",") if t.strip()}
    if "all" in names:
        return _ALL
    unknown = names - _ALL
    if unknown:
        raise ValueError(f"NNSCALER_COMM_FALLBACK names unknown collectives {sorted(unknown)}; "
                         f"use a comma-separated subset of {list(COLLECTIVES)} or 'all'")
    return frozenset(names)


_ENV_FORCED = _env_forced()


def _native_set(backend: str, device_type: str) -> FrozenSet[str]:
    backend = str(backend).lower()
    found = NATIVE.get((backend, device_type))
    if found is None:
        found = NATIVE.get((backend, "*"), frozenset())
    return found


def uses_fallback(collective: str, backend: str, device_type: str) -> bool:
    """Whether `collective` runs through its fallback for this backend and device type."""
    if collective in _FORCED or collective in _ENV_FORCED:
        return True
    return collective not in _native_set(backend, device_type)


def fallback_plan(backend: str, device_type: str = "cpu") -> Dict[str, str]:
    """``{collective: 'native' | fallback description}`` for a backend and device type."""
    return {c: FALLBACK_OF[c] if uses_fallback(c, backend, device_type) else "native"
            for c in COLLECTIVES}


@contextlib.contextmanager
def force_fallback(*collectives: str) -> Iterator[None]:
    """Run the named collectives (default: all) through their fallbacks inside the block.

    Every rank must enter it alike (the fallback runs a different collective)."""
    global _FORCED
    names = frozenset(collectives) if collectives else _ALL
    unknown = names - _ALL
    if unknown:
        raise ValueError(f"unknown collectives {sorted(unknown)}; choose from {list(COLLECTIVES)}")
    previous = _FORCED
    _FORCED = previous | names
    try:
        yield
    finally:
        _FORCED = previous
