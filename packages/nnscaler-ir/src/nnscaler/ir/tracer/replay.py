"""The first trace's results handed to the later traces of the same forward instead of computed again.

`trace` runs the forward more than once: in the other training mode (modes.py) and once per
flipped decision (branches.py). Every run starts from the same model state (trace_state.SavedState
puts it back) and mostly calls the same functions on the same tensors. The first trace keeps its
results (`CallResults()`); a later one (`first.next_trace()`) gives a call the result the first
trace computed for the same call instead of running it, where that result cannot differ:

* the same function, the same constant arguments, grad mode, autocast region and inference mode;
* the same tensors, by identity and version counter: parameters and buffers (put back between the
  traces), example inputs and captured constants (unless the first trace wrote them), and results
  handed out earlier in this trace, each written in place as often since as in the first trace;
  a result that is its input returned unchanged (``x.float()`` on float32, dropout in eval mode or
  with ``p=0``) counts as that input;
* the call is not in place, draws no random numbers (ops/random_ops.py), and wrote none of its
  inputs in the first trace. Calls that write an argument without its version counter (batch and
  instance norm's running statistics) and tensors whose ``.data`` the forward takes are followed
  no further.

Every other call runs, and so does every call on its results. Each stored result goes to one call
per trace (two identical calls get two tensors, as when they run). So a later trace records what
running it records: the same ops on tensors of the same shapes, dtypes and values, without running
the kernels it can take. Only the ``cpu`` trace strategy replays (elsewhere the forward's tensors are
per-trace copies on the trace device, trace_device.py), and the first trace keeps at most
`MAX_BYTES` of results (a later trace computes the rest), so tracing holds little more memory
than one trace did.
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch

from ..ops.random_ops import is_random_call
from .identity_results import returned_unchanged
from .trace_state import autocast_region

__all__ = ["CallResults", "MISS", "MAX_BYTES"]

MISS = object()  # what `take` returns when the call must run
MAX_BYTES = 1 << 30  # results the first trace keeps for the later ones, at most

# Functions that write a tensor argument without bumping its version counter (running statistics).
_SILENT_WRITERS = frozenset({"torch.nn.functional.batch_norm", "torch.batch_norm", "torch.native_batch_norm",
                             "torch._native_batch_norm_legit", "torch.nn.functional.instance_norm",
                             "torch.instance_norm"})
_SCALARS = (int, bool, str, complex, type(None))
_ATOMS = (torch.dtype, torch.device, torch.layout, torch.memory_format)


class _Unkeyable(Exception):
    """An argument the key cannot name exactly (an unknown tensor, an arbitrary object)."""


class _Store:
    """What the first trace keeps, shared by the traces that replay it."""

    def __init__(self):
        # key -> [(result, annotation, [(tensor, version when stored, content)])], in call order
        self.results: Dict[tuple, List[Tuple[Any, Optional[str], List[Tuple[torch.Tensor, int, Any]]]]] = {}
        # id -> (tensor, version when first seen, put back between traces): parameters, buffers,
        # example inputs, captured constants (kept alive here, so no id is reused while it lives)
        self.leaves: Dict[int, Tuple[torch.Tensor, int, bool]] = {}
        self.bytes = 0


class CallResults:
    """One trace's side of the replay: the first trace records (`CallResults()`), a later trace
    (`first.next_trace()`) takes. The tracer asks `key` before a call, `take` for a result to use
    instead of running it (with the call's annotation, which depends on nothing else), and tells
    `after` what the call gave."""

    def __init__(self, _store: Optional[_Store] = None):
        self._store = _store if _store is not None else _Store()
        self.replaying = _store is not None
        # id(tensor) -> (tensor, content, version base): the tensors whose values this trace can name.
        # content: the id of a leaf or of a stored result, or ("alias", content, writes) for a result
        # that is its input returned unchanged
        self._content: Dict[int, Tuple[torch.Tensor, Any, int]] = {}
        self._cursor: Dict[tuple, int] = {}
        self.taken = 0  # calls given a stored result (replaying)
        self.stored = 0  # results kept (recording)

    def next_trace(self) -> "CallResults":
        """The side of a later trace of the same forward (takes what this first trace kept)."""
        return CallResults(self._store)

    # -- the tensors that exist before the forward -------------------------------------------------
    def start(self, tensors: Iterable[torch.Tensor], restored: bool) -> None:
        """Parameters and buffers (`restored`: put back after each trace) or example inputs."""
        for t in tensors:
            self._leaf(t, restored)

    def constant(self, tensor: torch.Tensor) -> None:
        """A tensor the forward captured (neither an input, a parameter nor a result)."""
        self._leaf(tensor, False)

    def _leaf(self, t: torch.Tensor, restored: bool) -> None:
        version = _version(t)
        if version is None:
            return
        if not self.replaying:
            self._store.leaves[id(t)] = (t, version, restored)
        else:
            seen = self._store.leaves.get(id(t))
            if seen is None or seen[0] is not t or (not seen[2] and seen[1] != version):
                return  # new, or written by the first trace: not the tensor the first trace saw
        self._content[id(t)] = (t, id(t), version)

    def forget(self, tensor: Any) -> None:
        """`tensor` may change without its version counter (``.data`` was taken): name it no more."""
        if isinstance(tensor, torch.Tensor):
            self._content.pop(id(tensor), None)

    # -- calls -------------------------------------------------------------------------------------
    def key(self, func, target: str, args, kwargs) -> Optional[tuple]:
        """What identifies the call's result, or None when it cannot be named exactly."""
        if is_random_call(target, args, kwargs):
            return None
        try:
            key = (func, self._freeze(args), self._freeze(kwargs), torch.is_grad_enabled(),
                   tuple(autocast_region() or ()), torch.is_inference_mode_enabled())
            hash(key)
        except (_Unkeyable, TypeError):
            return None
        return key

    def take(self, key: tuple) -> Any:
        """(result, annotation) the first trace had for the call `key` names, or `MISS` (it runs)."""
        if not self.replaying:
            return MISS
        entries = self._store.results.get(key)
        i = self._cursor.get(key, 0)
        while entries is not None and i < len(entries):
            result, annotation, tensors = entries[i]
            i += 1
            if all(_version(t) == v for t, v, _ in tensors):  # not written since it was made
                self._cursor[key] = i
                for t, v, content in tensors:
                    self._content[id(t)] = (t, content, v)
                self.taken += 1
                return result, annotation
        if entries is not None:
            self._cursor[key] = i
        return MISS

    def after(self, key: Optional[tuple], target: str, args, inputs: Optional[dict], real, result,
              annotation: Optional[str], ran: bool) -> None:
        """A call gave `result` (the user's objects; `real` what the function returned; `inputs`:
        ``identity_results.traced_inputs`` of a call not in place). `ran`: it ran (not taken)."""
        if target in _SILENT_WRITERS:
            for t in _tensors(args):
                self.forget(t)
        if not ran:
            return
        outs = _outputs(result)
        befores = _outputs(real)
        if outs is None or befores is None or len(outs) != len(befores):
            return
        contents = []
        for before, out in zip(befores, outs):
            content = None
            if out is not None and inputs and returned_unchanged(before, inputs):
                hit = self._content.get(id(before))
                if hit is not None and hit[0] is before:
                    content = ("alias", hit[1], _version(before) - hit[2])
            contents.append(content)
        keep = (key is not None and not self.replaying and self._store.bytes < MAX_BYTES
                and all(_version(t) == v for t, v in (inputs or {}).values()))  # wrote no input
        if keep:
            tensors = [(out, _version(out), content if content is not None else id(out))
                       for out, content in zip(outs, contents) if out is not None]
            if any(v is None for _, v, _ in tensors):
                keep = False
        if keep:
            self._store.results.setdefault(key, []).append((result, annotation, tensors))
            self._store.bytes += sum(t.numel() * t.element_size() for t, _, _ in tensors)
            self.stored += 1
            for t, v, content in tensors:
                self._content[id(t)] = (t, content, v)
            return
        for out, content in zip(outs, contents):
            if content is not None:
                self._content[id(out)] = (out, content, _version(out))

    # -- keys --------------------------------------------------------------------------------------
    def _freeze(self, obj) -> Any:
        kind = type(obj)
        if kind is float:
            return (float, repr(obj))  # -0.0 and nan included
        if kind in _SCALARS:
            return (kind, obj)
        if isinstance(obj, torch.Tensor):
            hit = self._content.get(id(obj))
            version = _version(obj)
            if hit is None or hit[0] is not obj or version is None:
                raise _Unkeyable
            return (hit[1], version - hit[2])
        if isinstance(obj, int):  # a TracedInt: its value is what the function sees
            return (int, int(obj))
        if isinstance(obj, (tuple, list)):
            return (kind, tuple(self._freeze(x) for x in obj))
        if isinstance(obj, dict):
            return (dict, tuple((k, self._freeze(v)) for k, v in obj.items()))
        if kind is slice:
            return (slice, self._freeze(obj.start), self._freeze(obj.stop), self._freeze(obj.step))
        if obj is Ellipsis or isinstance(obj, _ATOMS):
            return (kind, obj)
        raise _Unkeyable


def _version(t: torch.Tensor) -> Optional[int]:
    try:
        return t._version
    except RuntimeError:  # inference tensors have no version counter
        return None


def _outputs(result) -> Optional[list]:
    """The tensors of a result (None entries kept), or None for a result that is not tensors."""
    if isinstance(result, torch.Tensor):
        return [result]
    if isinstance(result, (tuple, list)) and not isinstance(result, torch.Size) \
            and all(r is None or isinstance(r, torch.Tensor) for r in result):
        return list(result)
    return None


def _tensors(obj) -> List[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for x in obj for t in _tensors(x)]
    if isinstance(obj, dict):
        return [t for x in obj.values() for t in _tensors(x)]
    return []
