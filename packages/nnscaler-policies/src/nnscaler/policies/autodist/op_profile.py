"""Per-op compute time, profiled on this machine and cached in a database.

Every op is re-run alone with tensors of its traced shapes and dtypes (integer arguments
recomputed from the shapes, `int_values`): forward, then backward when an input needs a
gradient; the fastest of at least `repeats` runs after a warm-up (more runs, up to 20, while
they take under 5 ms in all): the minimum is the least disturbed by other processes sharing
the machine. Results are cached in
``<cache>/autodist/profile-<device>.json`` (`cache_dir`; ``<device>``: the device type, the CPU or
GPU model and the thread count) keyed by the op's signature (target, argument shapes, dtypes and
constants, grad mode; never its name, module path or position), so the copies of a layer are
measured once, and re-traces, deeper models of the same layer shapes and later runs reuse them;
``re_profile`` measures again. An op that cannot run alone (an argument we cannot rebuild) is
estimated from the bytes it reads and writes at the measured memory bandwidth, and marked
``estimated``. The measurements of the graph as a whole (calibration, CPU sharing) are keyed by
`mix_key`, the set of its distinct op signatures, so they carry over to a deeper model too.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import time
from pathlib import Path
from typing import Dict, Tuple

import torch

from nnscaler.ir import IRGraph, Node, Ref, atomic_write, iter_refs, resolve_target

from ..plan import tensor_inputs, tensor_outputs
from .choices import is_shape_query
from .int_values import int_values, substitute
from .progress import task
from .cost_model import nbytes

__all__ = ["ProfileDB", "cache_dir", "device_key", "profile_graph", "mix_key", "op_label", "optimizer_rate",
           "optimizer_tensor_cost"]


def cache_dir() -> Path:
    """``$NNSCALER_CACHE_DIR``, else ``$XDG_CACHE_HOME/nnscaler``, else ``~/.cache/nnscaler``."""
    env = os.environ.get("NNSCALER_CACHE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "nnscaler"


def device_key(device: str = "cpu") -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        name = torch.cuda.get_device_name(torch.device(device))
    else:
        name = f"{platform.machine()}-{platform.processor() or 'cpu'}-{torch.get_num_threads()}threads"
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in f"{device.split(':')[0]}-{name}")


class ProfileDB:
    """A JSON database: signature -> {"fwd": s, "bwd": s, "estimated": bool}."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.entries: Dict[str, dict] = {}
        self.hits = self.misses = 0
        if self.path.is_file():
            try:
                data = json.loads(self.path.read_text())
                self.entries = data.get("ops", {}) if isinstance(data, dict) else {}
            except (OSError, ValueError):
                self.entries = {}  # a damaged cache is measured again
        self.dirty = False

    def cached(self, key: str, measure, re_profile: bool = False) -> dict:
        """The entry under `key`, or `measure()`'s (a dict; a RuntimeError it raises is stored
        as ``{"error": message}``) measured now, stored and saved."""
        entry = None if re_profile else self.entries.get(key)
        if entry is None:
            try:
                entry = measure()
            except RuntimeError as e:
                entry = {"error": str(e)}
            self.entries[key] = entry
            self.dirty = True
            self.save()
        return entry

    def save(self) -> None:
        if self.dirty:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(self.path, json.dumps({"format": 1, "ops": self.entries}, sort_keys=True).encode())
            self.dirty = False


def _key(graph: IRGraph, node: Node, known) -> str:
    def enc(x):
        if isinstance(x, Ref):
            v = graph.value(x)
            if v.is_tensor:
                return f"T{tuple(v.shape or ())}:{v.dtype}:{int(v.requires_grad)}"
            return f"V{known.get(x.id, '?')}"
        if isinstance(x, (list, tuple)):
            return [enc(y) for y in x]
        if isinstance(x, dict):
            return {str(k): enc(v) for k, v in sorted(x.items())}
        if isinstance(x, slice):
            return ["slice", enc(x.start), enc(x.stop), enc(x.step)]
        return repr(x)
    return json.dumps([node.target, enc(node.args), enc(node.kwargs), node.grad_enabled], sort_keys=True)


def _profiled(graph: IRGraph, node: Node) -> bool:
    return not is_shape_query(node) and bool(tensor_inputs(graph, node) or tensor_outputs(graph, node))


def mix_key(graph: IRGraph) -> str:
    """A digest of the set of `graph`'s distinct op signatures: not of how many of each, nor of
    their names or order, so a deeper model of the same layer shapes has the same key (the cache
    key of the whole-graph measurements: calibration, CPU sharing)."""
    known = int_values(graph)
    signatures = sorted({_key(graph, node, known) for node in graph.nodes if _profiled(graph, node)})
    return hashlib.sha1(json.dumps(signatures).encode()).hexdigest()[:20]


def op_label(graph: IRGraph, node: Node) -> str:
    """What is profiled, for progress reports: the op's kind and its tensor arguments' shapes."""
    args = ", ".join(f"{tuple(graph.value(r).shape or ())} {graph.value(r).dtype}" for r in tensor_inputs(graph, node))
    return f"{node.short_name}({args})"


def _make(v, device):
    shape = tuple(v.shape or ())
    dtype = getattr(torch, v.dtype) if v.dtype and hasattr(torch, v.dtype) else torch.float32
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, dtype=dtype, device=device).requires_grad_(bool(v.requires_grad))
    if dtype == torch.bool:
        return torch.ones(shape, dtype=dtype, device=device)
    return torch.zeros(shape, dtype=dtype, device=device)


def _sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _measure(graph: IRGraph, node: Node, known, device: str, repeats: int) -> Tuple[float, float]:
    fn = resolve_target(node.target)
    args, kwargs = substitute(node.args, known), substitute(node.kwargs, known)
    if _non_tensor_refs(graph, (args, kwargs)):
        raise ValueError("an argument computed from something other than shapes")
    fwd_times, bwd_times = [], []
    i = 0
    while i <= repeats or (i <= 20 and sum(fwd_times) + sum(bwd_times) < 5e-3):
        made = {}

        def build(x):
            if isinstance(x, Ref):
                if x.id not in made:
                    made[x.id] = _make(graph.value(x), device)
                return made[x.id]
            if isinstance(x, list):
                return [build(y) for y in x]
            if isinstance(x, tuple):
                return tuple(build(y) for y in x)
            if isinstance(x, dict):
                return {k: build(v) for k, v in x.items()}
            if isinstance(x, slice):
                return slice(build(x.start), build(x.stop), build(x.step))
            return x
        a, k = build(args), build(kwargs)
        if node.inplace:
            a = [t.detach().clone() if isinstance(t, torch.Tensor) else t for t in a]
        _sync(device)
        t0 = time.perf_counter()
        with torch.set_grad_enabled(node.grad_enabled):
            out = fn(*a, **k)
        _sync(device)
        t1 = time.perf_counter()
        outs = [o for o in (out if isinstance(out, (tuple, list)) else [out])
                if isinstance(o, torch.Tensor) and o.requires_grad and o.grad_fn is not None]
        if outs:
            grads = [torch.ones_like(o) for o in outs]
            _sync(device)
            t2 = time.perf_counter()
            torch.autograd.backward(outs, grads)
            _sync(device)
            bwd = time.perf_counter() - t2
        else:
            bwd = 0.0
        if i:  # the first run warms up
            fwd_times.append(t1 - t0)
            bwd_times.append(bwd)
        i += 1
    return min(fwd_times), min(bwd_times)


def _non_tensor_refs(graph: IRGraph, obj) -> bool:
    return any(not graph.value(r).is_tensor for r in iter_refs(obj))


_BANDWIDTH: Dict[str, float] = {}


def memory_bandwidth(device: str = "cpu") -> float:
    """Bytes per second of a large copy (read + write counted), measured once per process."""
    if device not in _BANDWIDTH:
        x = torch.empty(32 * 1024 * 1024 // 4, device=device)
        y = torch.empty_like(x)
        best = math.inf
        for _ in range(3):
            _sync(device)
            t = time.perf_counter()
            y.copy_(x)
            _sync(device)
            best = min(best, time.perf_counter() - t)
        _BANDWIDTH[device] = 2 * x.numel() * 4 / best
    return _BANDWIDTH[device]


def _estimate(graph: IRGraph, node: Node, device: str) -> Tuple[float, float]:
    moved = sum(nbytes(graph.value(r).shape, graph.value(r).dtype)
                for r in tensor_inputs(graph, node) + tensor_outputs(graph, node))
    t = 2e-6 + moved / memory_bandwidth(device)
    return t, 2 * t


def profile_graph(graph: IRGraph, *, device: str = "cpu", re_profile: bool = False, repeats: int = 3,
                  db_path=None) -> Tuple[Dict[int, Tuple[float, float]], ProfileDB]:
    """node id -> (forward s, backward s) for every op with tensors, from the cache or measured."""
    db = ProfileDB(Path(db_path) if db_path else cache_dir() / "autodist" / f"profile-{device_key(device)}.json")
    known = int_values(graph)
    keys = {node.id: _key(graph, node, known) for node in graph.nodes if _profiled(graph, node)}
    todo: Dict[str, Node] = {}  # signature -> its first op: identical ops are measured once
    for node in graph.nodes:
        key = keys.get(node.id)
        if key is not None and key not in todo and (re_profile or key not in db.entries):
            todo[key] = node
    with task("op", len(todo)) as progress:
        for key, node in todo.items():
            progress.advance(op_label(graph, node))
            try:
                fwd, bwd = _measure(graph, node, known, device, repeats)
                entry = {"fwd": fwd, "bwd": bwd, "estimated": False}
            except Exception as e:  # noqa: BLE001 - any op failing alone is estimated instead
                fwd, bwd = _estimate(graph, node, device)
                entry = {"fwd": fwd, "bwd": bwd, "estimated": True, "why": f"{type(e).__name__}: {e}"[:200]}
            db.entries[key] = entry
            db.dirty = True
    db.misses += len(todo)
    db.hits += len(keys) - len(todo)
    times = {nid: (float(db.entries[key]["fwd"]), float(db.entries[key]["bwd"])) for nid, key in keys.items()}
    db.save()
    return times, db


_OPTIMIZER_KEY = "__optimizer__:torch.optim.Adam:float32"
_OPTIMIZER_TENSOR_KEY = "__optimizer_per_tensor__:torch.optim.Adam:float32"
_OPTIMIZER_SHAPE_KEY = "__optimizer_shape__:torch.optim.Adam:float32"  # seconds per tensor of a shape
_OPTIMIZER_MAX_NUMEL = 1 << 24  # measure the optimizer on the model's own shapes up to this size (each)


def _adam_seconds(params, device: str) -> float:
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.Adam(params, lr=1e-3)
    best = math.inf
    for i in range(6):
        _sync(device)
        t = time.perf_counter()
        opt.step()
        _sync(device)
        if i:
            best = min(best, time.perf_counter() - t)
    return best


def optimizer_tensor_cost(db: ProfileDB, device: str = "cpu", re_profile: bool = False) -> float:
    """Seconds an Adam step spends per parameter tensor apart from its elements (its dozen
    small kernel calls): measured on 64 one-element tensors, cached in `db`. On CPU it is about
    30 us, 1.5 ms a step for a 70-tensor model, as much as the elements of 500 K parameters."""
    def measure() -> dict:
        params = [torch.nn.Parameter(torch.randn(1, device=device)) for _ in range(64)]
        return {"per_tensor": _adam_seconds(params, device) / 64}

    return float(db.cached(_OPTIMIZER_TENSOR_KEY, measure, re_profile)["per_tensor"])


def optimizer_rate(db: ProfileDB, device: str = "cpu", re_profile: bool = False, shapes=None) -> float:
    """Seconds per parameter element of an Adam step (fp32, torch's default implementation), the
    per-tensor cost (`optimizer_tensor_cost`) apart, cached in `db`. Each distinct shape of the
    model's parameter `shapes` is measured once (a step over up to 8 copies of it, 64K elements if
    small; the fastest of 5 steps after a warm-up) and weighted by how many tensors
    have it, so a deeper model of the same layer shapes measures nothing new; a shape over
    `_OPTIMIZER_MAX_NUMEL` elements, and a model given no shapes, use the rate of 1M elements in
    16 tensors. The rate depends on the tensors' sizes: a 1M-element tensor (16 MB of Adam state,
    out of cache) took 4.3 ns per element here, 64K-element tensors 1.0 ns."""
    counts: Dict[tuple, int] = {}
    for sh in shapes or ():
        sh = tuple(int(d) for d in sh)
        if 0 < math.prod(sh) <= _OPTIMIZER_MAX_NUMEL:
            counts[sh] = counts.get(sh, 0) + 1
    large = [tuple(int(d) for d in sh) for sh in shapes or () if math.prod(sh) > _OPTIMIZER_MAX_NUMEL]
    if not counts:
        return _default_rate(db, device, re_profile)
    per_tensor = optimizer_tensor_cost(db, device, re_profile)
    keys = {sh: f"{_OPTIMIZER_SHAPE_KEY}:{list(sh)}" for sh in counts}
    todo = [sh for sh in counts if re_profile or keys[sh] not in db.entries]
    with task("optimizer", len(todo)) as progress:
        for sh in todo:
            progress.advance(f"Adam step on {sh}")
            copies = max(1, min(8, (1 << 16) // math.prod(sh)))  # a few copies of a small tensor: a step to time
            params = [torch.nn.Parameter(torch.randn(sh, device=device)) for _ in range(copies)]
            db.entries[keys[sh]] = {"seconds": _adam_seconds(params, device) / copies}
            db.dirty = True
    db.save()
    seconds = sum(n * max(float(db.entries[keys[sh]]["seconds"]) - per_tensor,
                          0.1 * float(db.entries[keys[sh]]["seconds"])) for sh, n in counts.items())
    numel = sum(n * math.prod(sh) for sh, n in counts.items())
    if large:  # too large to measure alone: the default tensors' rate
        big = sum(math.prod(sh) for sh in large)
        return (seconds + big * _default_rate(db, device, re_profile)) / (numel + big)
    return seconds / numel


def _default_rate(db: ProfileDB, device: str, re_profile: bool) -> float:
    shapes, numel = [(1 << 16,)] * 16, 1 << 20
    digest = hashlib.sha1(json.dumps(sorted(shapes)).encode()).hexdigest()[:16]

    def measure() -> dict:
        per_tensor = optimizer_tensor_cost(db, device, re_profile)
        params = [torch.nn.Parameter(torch.randn(sh, device=device)) for sh in shapes]
        seconds = _adam_seconds(params, device)
        return {"per_element": max(seconds - per_tensor * len(shapes), 0.1 * seconds) / numel}

    return float(db.cached(f"{_OPTIMIZER_KEY}:{digest}", measure, re_profile)["per_element"])
