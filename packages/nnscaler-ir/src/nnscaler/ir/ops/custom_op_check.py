"""Checking a user's `register_op` annotation on the call being traced.

The built-in annotations are checked numerically by the tests (tests/ir/test_registry.py); a
user's annotation is checked the same way the first time the op is traced with given shapes:

1. the annotation must fit the call: every tensor argument and output has the rank the annotation
   gives it and every dim name has one size (else a `TraceError` naming the op and the argument,
   instead of a node the policies silently replicate);
2. for every dim the annotation lets a policy split, the example inputs are split along it
   (`Shard` → consecutive slices, an additive input of a split reduced dim → value-split pieces,
   others whole), the op runs on each piece, and the pieces of each output are put back together
   per its placement (concatenated, summed, or each equal to the whole); the result must equal the
   op run on the whole inputs within a tolerance for the dtype. A dim that fails is refused with
   the fix: mark it ``^`` (may not be split).

The outcome is cached per (op, annotation, argument shapes and dtypes): a model that calls the op
in every layer is checked once. Meta tensors (``trace_strategy='meta'``) have no values: only the
shape check runs for them.
"""
from __future__ import annotations

import contextlib
import inspect
import re
from typing import Any, Callable, Dict, List, Optional

import torch

from .annotation import parse_annotation
from .annotation_specs import AnnotationError
from .bound_annotation import BoundAnnotation
from ..errors import TraceError
from ..layout import Partial, Replicate, Shard, TensorLayout
from ..tree import replace_tensors, tensor_leaves
from ..user_code import is_internal

__all__ = ["check_custom_op", "clear_cache", "TOLERANCES"]

# Relative tolerance (to the largest magnitude of the whole output) per floating dtype; integer and
# bool outputs must be equal. Loose enough for a summation done in another order, far below the
# error of a wrong annotation (a cumsum split along its dim is off by whole rows).
TOLERANCES = {torch.float64: 1e-9, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2,
              torch.complex128: 1e-9, torch.complex64: 1e-5}

_CACHE: Dict[tuple, Optional[str]] = {}  # key -> None (checked, fine) or the error message


def clear_cache() -> None:
    """Forget every checked (op, annotation, shapes); the next trace checks again."""
    _CACHE.clear()


def check_custom_op(name: str, fn: Callable, annotation: Optional[str], args: tuple, kwargs: dict,
                    result: Any) -> None:
    """Refuse `annotation` for the call ``fn(*args, **kwargs) -> result`` when it does not fit the
    shapes, or when splitting along a dim it allows changes the numbers. `name` is the op's
    registered name (used in messages)."""
    if annotation is None:
        return
    ins, outs = tensor_leaves((args, kwargs)), tensor_leaves(result)
    key = (fn, annotation, tuple((tuple(t.shape), t.dtype) for t in ins),
           tuple((tuple(t.shape), t.dtype) for t in outs))
    try:
        cached = _CACHE.get(key, False)
    except TypeError:  # an unhashable fn: check every time
        cached, key = False, None
    if cached is False:
        with _not_recorded():
            cached = _check(name, fn, annotation, args, kwargs, ins, outs)
        if key is not None:
            _CACHE[key] = cached
    if cached is not None:
        loc = _user_line()
        raise TraceError(cached + (f" (called at {loc})" if loc else ""))


def _check(name, fn, annotation, args, kwargs, ins, outs) -> Optional[str]:
    labels = _argument_labels(fn, args, kwargs)
    try:
        bound = parse_annotation(annotation).bind([tuple(t.shape) for t in ins],
                                                  [tuple(t.shape) for t in outs])
    except AnnotationError as e:
        return _misfit_message(name, annotation, e, ins, outs, labels)
    if any(t.device.type == "meta" for t in ins + outs):
        return None  # no values to compare
    cuda = sorted({t.device.index or 0 for t in ins + outs if t.device.type == "cuda"})
    with torch.random.fork_rng(devices=cuda):  # the check draws no random number the trace would see
        # the reference is the op on copies of the inputs as they are now (an in-place op has changed
        # them since the traced call); an op that differs between two runs (random) cannot be checked
        whole = _whole_call(fn, args, kwargs, ins)
        if whole is None or _whole_call(fn, args, kwargs, ins, compare_to=whole) is None:
            return None
        for dim in bound.splittable_dims():
            n = _smallest_factor(bound.sizes[dim])
            problem = _split_problem(fn, args, kwargs, ins, whole, bound, dim, n)
            if problem is not None:
                return _wrong_split_message(name, annotation, bound, dim, n, problem, labels)
    return None


def _whole_call(fn, args, kwargs, ins, compare_to=None):
    """The op's tensor outputs on copies of the inputs; None when it fails, or when it differs from
    `compare_to` (a nondeterministic op)."""
    a, k = replace_tensors((args, kwargs), [t.detach().clone() for t in ins])
    try:
        out = tensor_leaves(_run(fn, a, k))
    except Exception:  # noqa: BLE001 - it ran in the trace: a failure here means it cannot be re-run
        return None
    if compare_to is not None and (len(out) != len(compare_to) or not all(
            o.shape == c.shape and torch.equal(o, c) or (o.is_floating_point() and torch.equal(o.isnan(), c.isnan())
                                                         and torch.equal(o.nan_to_num(), c.nan_to_num()))
            for o, c in zip(out, compare_to))):
        return None
    return out


# -- running the pieces --------------------------------------------------------------------------------

def _split_problem(fn, args, kwargs, ins, outs, bound: BoundAnnotation, dim: str, n: int) -> Optional[str]:
    in_places, out_places = bound.partition(dim, n)
    results = []
    for i in range(n):
        local = [_piece(t, p, n, i) for t, p in zip(ins, in_places)]
        a, k = replace_tensors((args, kwargs), local)
        try:
            got = _run(fn, a, k)
        except Exception as e:  # the op cannot even run on a piece
            return f"running it on piece {i} of {n} raised {type(e).__name__}: {e}"
        got = tensor_leaves(got)
        if len(got) != len(outs):
            return f"piece {i} returned {len(got)} tensor(s) instead of {len(outs)}"
        results.append(got)
    for j, (want, place) in enumerate(zip(outs, out_places)):
        pieces = [r[j] for r in results]
        try:
            if isinstance(place, Shard):
                combined = [torch.cat(pieces, dim=place.dim)]
            elif isinstance(place, Partial):
                combined = [sum(pieces[1:], pieces[0])]
            else:
                combined = pieces  # replicated: every piece must be the whole output
        except RuntimeError as e:
            return f"its pieces of output {j} do not fit together ({e})"
        for c in combined:
            diff = _difference(c, want)
            if diff is not None:
                how = {Shard: "concatenated", Partial: "summed", Replicate: "taken whole"}[type(place)]
                return f"output {j} ({how}) differs from the whole call: {diff}"
    return None


def _run(fn, args, kwargs):
    with torch.no_grad():
        return fn(*args, **kwargs)


@contextlib.contextmanager
def _not_recorded():
    """The check's own torch calls (and the op's runs on pieces) are not part of the trace."""
    if torch._C._len_torch_function_stack() > 0:  # the tracer's recording mode is on
        with torch.overrides._pop_mode_temporarily():
            yield
    else:
        yield


def _piece(t: torch.Tensor, place, n: int, i: int) -> torch.Tensor:
    t = t.detach()
    if isinstance(place, Partial):  # an additive input: the pieces add up to it
        return t.clone() if i == 0 else torch.zeros_like(t)
    if isinstance(place, Shard):
        lay = TensorLayout(tuple(t.shape), place, n, i)
        return t[tuple(slice(a, b) for a, b in lay.slices())].clone()
    return t.clone()




def _difference(got: torch.Tensor, want: torch.Tensor) -> Optional[str]:
    """None when `got` equals `want` within the dtype's tolerance, else what differs."""
    if tuple(got.shape) != tuple(want.shape):
        return f"shape {tuple(got.shape)} instead of {tuple(want.shape)}"
    got, want = got.detach(), want.detach().to(got.device)
    if not (want.is_floating_point() or want.is_complex()):
        return None if torch.equal(got, want) else "different values (exact comparison)"
    g, w = got.to(torch.complex128 if want.is_complex() else torch.float64), \
        want.to(torch.complex128 if want.is_complex() else torch.float64)
    same_nan = torch.isnan(g) == torch.isnan(w)
    if not bool(same_nan.all()):
        return "NaN at different places"
    finite = ~torch.isnan(w)
    if not bool(finite.any()):
        return None
    err = float((g - w)[finite].abs().max())
    scale = float(w[finite].abs().max())
    tol = TOLERANCES.get(want.dtype, 1e-5)
    if err <= tol * max(scale, 1e-30):
        return None
    return f"largest difference {err:.3g} (largest magnitude {scale:.3g}, tolerance for {_dtype(want)} {tol:g} relative)"


# -- messages -------------------------------------------------------------------------------------------

def _misfit_message(name, annotation, error: AnnotationError, ins, outs, labels) -> str:
    reason = error.reason if hasattr(error, "reason") else str(error)
    which = []
    for m in re.finditer(r"(input|output) (\d+)", reason):
        kind, i = m.group(1), int(m.group(2))
        if kind == "input" and i < len(ins):
            which.append(f"input {i} is argument {labels[i]} with shape {tuple(ins[i].shape)}")
        elif kind == "output" and i < len(outs):
            which.append(f"output {i} has shape {tuple(outs[i].shape)}")
    which = list(dict.fromkeys(which))
    shapes = ", ".join(f"{lab} {tuple(t.shape)}" for lab, t in zip(labels, ins)) or "none"
    return (f"custom op {name}: its annotation {annotation!r} does not fit this call: {reason}"
            + (f" ({'; '.join(which)})" if which else "")
            + f". Its tensor arguments are: {shapes}; outputs: "
            + (", ".join(str(tuple(t.shape)) for t in outs) or "none")
            + ". Fix the annotation so it has one entry per tensor argument and output, with one name "
              "per dim (use '...' for a varying number of leading dims), and register it again with "
              "register_op(..., override=True)")


def _wrong_split_message(name, annotation, bound, dim, n, problem, labels) -> str:
    where = [f"{labels[i]} dim {names.index(dim)}" for i, names in enumerate(bound.inputs)
             if names is not None and dim in names]
    fixed = _mark_frozen(annotation, dim)
    fix = (f"mark it '^' (may not be split): register_op(..., {fixed!r}, override=True)" if fixed else
           f"write the dims out instead of '...' and mark {dim!r} with '^' (may not be split)")
    return (f"custom op {name}: its annotation {annotation!r} lets a policy split dim {dim!r}"
            + (f" ({', '.join(where)})" if where else "") + f", but splitting the example inputs along it "
            f"into {n} pieces gives different numbers: {problem}. The op mixes values along {dim!r}, "
            f"so a tensor-parallel plan would train on wrong numbers. If it really does, {fix}; if the "
            f"op is right and the annotation names the wrong dim, fix the annotation")


def _mark_frozen(annotation: str, dim: str) -> Optional[str]:
    pattern = re.compile(rf"(?<![A-Za-z0-9_]){re.escape(dim)}(\+|\^)?(?![A-Za-z0-9_.])")
    if not pattern.search(annotation):
        return None
    return pattern.sub(f"{dim}^", annotation, count=1)


def _argument_labels(fn, args, kwargs) -> List[str]:
    """A name per tensor leaf of ``(args, kwargs)``: ``'x'``, ``'xs[1]'``, ``'inputs["k"]'``."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        params = []
    names = []
    for i, _ in enumerate(args):
        if i < len(params) and params[i].kind in (params[i].POSITIONAL_ONLY, params[i].POSITIONAL_OR_KEYWORD):
            names.append(params[i].name)
        else:
            names.append(f"positional argument {i}")
    labels: List[str] = []

    def walk(x, label):
        if isinstance(x, torch.Tensor):
            labels.append(repr(label) if "[" not in label else label)
        elif isinstance(x, (list, tuple)) and not isinstance(x, torch.Size):
            for j, y in enumerate(x):
                walk(y, f"{label}[{j}]")
        elif isinstance(x, dict):
            for k, y in x.items():
                walk(y, f"{label}[{k!r}]")

    for a, label in zip(args, names):
        walk(a, label)
    for k, v in kwargs.items():
        walk(v, k)
    return labels


def _user_line() -> Optional[str]:
    import sys
    frame = sys._getframe(1)
    while frame is not None and is_internal(frame.f_code.co_filename):
        frame = frame.f_back
    return f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame is not None else None


def _smallest_factor(size: int) -> int:
    for f in range(2, int(size ** 0.5) + 1):
        if size % f == 0:
            return f
    return size


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")
