"""The whole graph's forward + backward time, run eagerly on one device: the compute model's
calibration.

Ops profiled alone (op_profile.py) sum to less than the model they make: alone, each op runs
hot in cache, and the autograd bookkeeping between ops and the backward engine's walk are not
counted. The sum was 4-15 % under the model's eager time (bench/autodist.py, more for small
per-rank batches). `graph_seconds` runs the traced graph once as a program (parameters and
inputs made from their shapes, as the profiler does) and times it; the search multiplies every
op's profiled time by measured / profiled sum (measured back to back, as training runs: the
factor also turns the ops' fastest times into typical ones). The factor is cached in the profile
database by `op_profile.mix_key`, the set of the graph's distinct ops: a deeper model of the same
layer shapes reuses the factor of the first one measured. A graph that cannot run whole (an
input we cannot rebuild, a traced branch on a tensor's value) or would not fit on the device is
not calibrated (factor 1), and the estimate says why.
"""
from __future__ import annotations

import builtins
import math
import os
import statistics
import time
from typing import Dict, Optional, Tuple

import torch

from nnscaler.ir import IRGraph, Ref, is_guard, iter_refs, resolve_target

from .int_values import substitute
from .op_profile import ProfileDB, _make, _sync, mix_key
from .progress import task
from .cost_model import nbytes

__all__ = ["graph_seconds", "calibration", "calibration_key"]

# Calibrate only graphs whose parameters and outputs take at most this share of the free memory,
# and whose profiled time is at most this many seconds (the run repeats it a few times).
_MEMORY_SHARE = 0.25
_MAX_SECONDS = 5.0
# The whole graph is timed over blocks of back-to-back runs lasting about BLOCK_S, BLOCKS of them.
BLOCK_S = 0.15
BLOCKS = 3
# A factor outside these bounds means the run measured something else than the ops (a machine
# suddenly busy): the ops' own times are kept.
_BOUNDS = (0.5, 2.0)


class _CannotRun(Exception):
    pass


def _fill(structure, obj, env: Dict[int, object]) -> None:
    if isinstance(structure, Ref):
        env[structure.id] = obj
    elif isinstance(structure, (list, tuple)) and isinstance(obj, (list, tuple)):
        for s, o in zip(structure, obj):
            _fill(s, o, env)


def _read(obj, env: Dict[int, object]):
    """`obj` with every Ref replaced by its computed value (`int_values.substitute`)."""
    out = substitute(obj, env)
    for ref in iter_refs(out):
        raise _CannotRun(f"value {ref.id} is not known")
    return out


def _program(graph: IRGraph) -> list:
    """(node, function) in order, the functions looked up before the clock starts."""
    found: Dict[str, object] = {}
    steps = []
    for node in graph.nodes:
        if node.only_when is False or is_guard(node):  # eval-only; a guard checks the traced data
            continue
        if node.branch is not None:
            raise _CannotRun("a traced branch on a tensor's value")
        if node.target not in found:
            found[node.target] = getattr(builtins, node.target) if "." not in node.target \
                else resolve_target(node.target)
        steps.append((node, found[node.target]))
    return steps


def _inputs(graph: IRGraph, device: str) -> Dict[int, object]:
    """Inputs, parameters, buffers and constants made from their shapes."""
    env: Dict[int, object] = {}
    for spec in graph.inputs:
        for _, ref in spec.leaves:
            v = graph.value(ref)
            if not v.is_tensor:
                raise _CannotRun(f"input {spec.name} holds a non-tensor value")
            env[ref.id] = _make(v, device)
    for table in (graph.params, graph.buffers, graph.constants):
        for spec in table.values():
            env[spec.value.id] = _make(graph.value(spec.value), device)
    return env


def _execute(graph: IRGraph, steps: list, env: Dict[int, object]) -> None:
    """One forward + backward of the program on `env` (filled with every value it makes)."""
    for node, fn in steps:
        args, kwargs = _read(node.args, env), _read(node.kwargs, env)
        with torch.set_grad_enabled(node.grad_enabled):
            if node.autocast:
                with torch.autocast(node.autocast[0], dtype=getattr(torch, node.autocast[1])):
                    out = fn(*args, **kwargs)
            else:
                out = fn(*args, **kwargs)
        _fill(node.outputs, out, env)
    outs = [env[r.id] for r in iter_refs(graph.output) if r.id in env]
    outs = [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad and o.grad_fn is not None]
    if outs:
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])


def _run_once(graph: IRGraph, steps: list, device: str) -> float:
    """Seconds of one forward + backward on fresh inputs (their making not timed)."""
    env = _inputs(graph, device)
    _sync(device)
    t0 = time.perf_counter()
    _execute(graph, steps, env)
    _sync(device)
    return time.perf_counter() - t0


def _free_bytes(device: str) -> float:
    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return float(free)
    try:
        return float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return math.inf


def _graph_bytes(graph: IRGraph) -> float:
    return sum(nbytes(v.shape, v.dtype) for v in graph.values.values() if v.is_tensor)


def graph_seconds(graph: IRGraph, device: str = "cpu") -> float:
    """Seconds per eager forward + backward run of the whole graph, as training runs it: back to
    back, over blocks of about `BLOCK_S` (the median of `BLOCKS` blocks, after a warm-up): a
    typical run, not the fastest, and timed the same way as `cpu_sharing` times it beside its
    peers. Raises ``RuntimeError`` with the reason when it cannot run."""
    need = 2 * _graph_bytes(graph)  # every value and its gradient, an upper bound
    if need > _MEMORY_SHARE * _free_bytes(device):
        raise RuntimeError(f"the graph needs up to {need / 2 ** 30:.2f} GiB, more than "
                           f"{_MEMORY_SHARE:.0%} of the free memory of {device}")
    try:
        steps = _program(graph)
        runs = block_runs(graph, steps, device)
        return statistics.median(block_seconds(graph, steps, device, runs) for _ in range(BLOCKS))
    except _CannotRun as e:
        raise RuntimeError(str(e)) from None
    except Exception as e:  # noqa: BLE001 - any failure means: not calibrated
        raise RuntimeError(f"{type(e).__name__}: {e}"[:200]) from None


def block_runs(graph: IRGraph, steps: list, device: str) -> int:
    """How many runs make a block of about `BLOCK_S` (after a warm-up run)."""
    _run_once(graph, steps, device)
    return max(1, math.ceil(BLOCK_S / max(_run_once(graph, steps, device), 1e-6)))


def block_seconds(graph: IRGraph, steps: list, device: str, runs: int) -> float:
    """Seconds per run of `runs` forward + backward runs back to back (the same inputs and
    parameters: making them is not timed)."""
    base = _inputs(graph, device)
    _sync(device)
    t = time.perf_counter()
    for _ in range(runs):
        _execute(graph, steps, dict(base))
    _sync(device)
    return (time.perf_counter() - t) / runs


def calibration_key(graph: IRGraph) -> str:
    """The profile database's key of the graph's calibration (its op mix, not its depth)."""
    return f"__graph__:mix:{mix_key(graph)}"


def calibration(graph: IRGraph, op_times: Dict[int, Tuple[float, float]], db: ProfileDB, device: str,
                re_profile: bool = False) -> Tuple[float, Optional[str]]:
    """(factor, why not calibrated or None): measured whole-graph seconds over the sum of the
    profiled op times, cached in `db` under the graph's op mix (`calibration_key`)."""
    profiled = sum(f + b for f, b in op_times.values())
    if profiled <= 0:
        return 1.0, "no profiled ops"
    key = calibration_key(graph)
    if (re_profile or key not in db.entries) and profiled > _MAX_SECONDS:  # not stored: a smaller model may run
        return 1.0, f"the profiled ops take {profiled:.1f} s, over {_MAX_SECONDS} s"

    def measure() -> dict:
        with task("graph", 1) as progress:
            progress.advance(f"the whole graph, forward + backward ({len(op_times)} ops)")
            return {"seconds": graph_seconds(graph, device), "ops_seconds": profiled}

    entry = db.cached(key, measure, re_profile)
    if "seconds" not in entry:
        return 1.0, entry.get("error", "not measured")
    factor = float(entry["seconds"]) / float(entry.get("ops_seconds", profiled))
    if not _BOUNDS[0] <= factor <= _BOUNDS[1]:
        return 1.0, f"the whole graph took {factor:.2f}x its ops' sum, outside {_BOUNDS}"
    return factor, None
