"""Einsum-like dimension annotations of operators.

Grammar (``parse_annotation``)::

    annotation := tensors '->' tensors
    tensors    := tensor (',' tensor)*
    tensor     := '?' | ['+'] dim (' ' dim)*
    dim        := NAME ['+' | '^'] | '1' | [NAME] '...' | '(' NAME ['^'] (' ' NAME ['^'])* ')'
    NAME       := [A-Za-z_][A-Za-z0-9_]*

* ``k+``  a reduced dim: it appears in no output; splitting it makes the outputs value-split
  (``Partial``, partial sums).
* ``d^``  a dim that may not be split (softmax's dim, a norm's normalized dims, ...). An output
  dim must appear in some input unless it is ``^`` (a new dim, e.g. the stacked dim of ``stack``).
  Markers are global: ``d^`` anywhere freezes ``d`` everywhere.
* ``1``   a dim of size 1 (never split). A tensor annotated by ``1`` alone also binds to a 0-dim
  (scalar) tensor.
* ``...`` (or ``b...``, naming the expanded dims ``b0 b1 ...``) any number of dims, right-aligned
  across tensors as in broadcasting; at most one per tensor, the same name throughout. A size-1
  dim of an input's expansion that broadcasts against a larger size is bound as ``1``.
* ``(h d)`` a group: one dim of the tensor whose size is the product of its members', as where a
  reshape merges or splits dims (``b s (h d) -> b s h d``). Splitting the *first* member splits
  the grouped dim into contiguous pieces; the other members are never split (implicitly ``^``).
  A member's size comes from another tensor where it stands alone, or, for one unknown member,
  from the grouped dim's size.
* ``?``   an input tensor that is not annotated (it is passed whole, e.g. a mask).
* ``+n``  (a leading ``+`` on an input) an *additive* input, like a bias: when a reduced dim it
  lacks is split, it is value-split (``V``) like the outputs instead of replicated, so that the
  partial results add up to the full one (``b... k+, n k+, +n -> b... n``).

A dim of an input that is in no output and not marked ``+`` is not splittable (e.g. an argmax).
"""
from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from nnscaler.ir.errors import NnScalerError
from nnscaler.ir.layout import Partial, Placement, Replicate, Shard

__all__ = ["AnnotationError", "DimSpec", "TensorSpec", "OpAnnotation", "BoundAnnotation",
           "parse_annotation"]

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
ELLIPSIS = "..."


class AnnotationError(NnScalerError, ValueError):
    """A malformed annotation, or shapes / a partition that do not fit one.

    For syntax errors ``position`` is the offending character's offset in ``annotation`` and the
    message shows the annotation with a caret under that character.
    """

    def __init__(self, reason: str, annotation: Optional[str] = None,
                 position: Optional[int] = None):
        self.reason, self.annotation, self.position = reason, annotation, position
        msg = reason
        if annotation is not None:
            msg = f"{reason}\n    {annotation}"
            if position is not None:
                msg += "\n    " + " " * position + "^"
        super().__init__(msg)


@dataclass(frozen=True)
class DimSpec:
    """One dim of a tensor entry: ``name`` is an identifier, ``"1"`` or ``"..."``."""

    name: str  # for a group: "(" + member names + ")"
    marker: str = ""  # "", "+" or "^"
    ellipsis_name: str = ""  # the NAME of ``NAME...``
    pos: int = field(default=0, compare=False)
    members: Tuple["DimSpec", ...] = ()  # the members of a group ``(a b)``

    def __str__(self) -> str:
        if self.members:
            return "(" + " ".join(str(m) for m in self.members) + ")"
        return (self.ellipsis_name + ELLIPSIS) if self.name == ELLIPSIS else self.name + self.marker


@dataclass(frozen=True)
class TensorSpec:
    """One tensor entry; ``dims`` is None for ``?`` (an unannotated tensor)."""

    dims: Optional[Tuple[DimSpec, ...]]
    pos: int = field(default=0, compare=False)
    additive: bool = False

    def __str__(self) -> str:
        if self.dims is None:
            return "?"
        return ("+" if self.additive else "") + " ".join(str(d) for d in self.dims)


@dataclass(frozen=True)
class OpAnnotation:
    """A parsed annotation; ``bind`` it to concrete shapes to partition an op."""

    text: str
    inputs: Tuple[TensorSpec, ...]
    outputs: Tuple[TensorSpec, ...]
    reduced: frozenset
    frozen: frozenset

    def __str__(self) -> str:
        return self.text

    def __repr__(self) -> str:
        return f"OpAnnotation({self.text!r})"

    def bind(self, input_shapes: Sequence[Optional[Sequence[int]]],
             output_shapes: Sequence[Optional[Sequence[int]]]) -> "BoundAnnotation":
        """Bind to the shapes of the tensor inputs/outputs (None for a ``?`` / non-tensor entry)."""
        return _bind(self, input_shapes, output_shapes)


def _fail(reason: str, text: str, pos: int):
    raise AnnotationError(f"invalid annotation: {reason}", text, pos)


def _parse_tensor(text: str, start: int, stop: int, is_output: bool) -> TensorSpec:
    dims: List[DimSpec] = []
    i, additive = start, False
    while i < stop and text[i].isspace():
        i += 1
    if i < stop and text[i] == "+":
        if is_output:
            _fail("a leading '+' (an additive input) is allowed for inputs only", text, i)
        additive, i = True, i + 1
        if i < stop and text[i] in "?+^" or i < stop and text[i].isspace():
            _fail("expected a dim right after the additive-input '+'", text, i)
    while True:
        while i < stop and text[i].isspace():
            i += 1
        if i >= stop:
            break
        c, tok = text[i], i
        if c == "?":
            if is_output:
                _fail("'?' (an unannotated tensor) is allowed for inputs only", text, i)
            if dims or additive or text[i + 1:stop].strip():
                _fail("'?' must be the whole tensor entry", text, i)
            return TensorSpec(None, tok)
        if c == "(":
            dims.append(_parse_group(text, i, stop))
            i = text.index(")", i) + 1
        elif text.startswith(ELLIPSIS, i):
            dims.append(DimSpec(ELLIPSIS, pos=tok))
            i += 3
        elif c == "1" and not (i + 1 < stop and (text[i + 1].isalnum() or text[i + 1] == "_")):
            dims.append(DimSpec("1", pos=tok))
            i += 1
        elif _NAME.match(text, i):
            m = _NAME.match(text, i)
            name, i = m.group(0), m.end()
            if text.startswith(ELLIPSIS, i):
                dims.append(DimSpec(ELLIPSIS, ellipsis_name=name, pos=tok))
                i += 3
            elif i < stop and text[i] in "+^":
                dims.append(DimSpec(name, text[i], pos=tok))
                i += 1
            else:
                dims.append(DimSpec(name, pos=tok))
        elif c.isdigit():
            _fail("expected a dim name; the only number allowed is the size-1 dim '1'", text, i)
        else:
            _fail(f"unexpected character {c!r}: expected a dim name, '1', '...' or '?'", text, i)
        if i < stop and not text[i].isspace():
            if text[i] in "+^":
                _fail(f"unexpected {text[i]!r}: markers go on named dims only", text, i)
            _fail(f"unexpected {text[i]!r}: expected a space between dims", text, i)
    if not dims:
        _fail("empty tensor entry: expected a dim, '1', '...' or '?'", text, stop)
    return TensorSpec(tuple(dims), start, additive)


def _parse_group(text: str, start: int, stop: int) -> DimSpec:
    members: List[DimSpec] = []
    i = start + 1
    while True:
        while i < stop and text[i] == " ":
            i += 1
        if i < stop and text[i] == ")":
            break
        m = _NAME.match(text, i)
        if i >= stop or not m:
            what = "a member name or ')'" if members else "a member name"
            _fail(f"expected {what} in the group opened at column {start}", text, i)
        marker = "^" if m.end() < stop and text[m.end()] == "^" else ""
        members.append(DimSpec(m.group(0), marker, pos=i))
        i = m.end() + len(marker)
        if i < stop and text[i] not in " )":
            _fail(f"unexpected {text[i]!r} in a group: members are names, optionally with '^'",
                  text, i)
    if not members:
        _fail("empty group '()'", text, i)
    return DimSpec("(" + " ".join(d.name for d in members) + ")", pos=start,
                   members=tuple(members))


def _parse_side(text: str, start: int, stop: int, is_output: bool) -> List[TensorSpec]:
    out, i = [], start
    while True:
        j = text.find(",", i, stop)
        j = stop if j < 0 else j
        out.append(_parse_tensor(text, i, j, is_output))
        if j == stop:
            return out
        i = j + 1


def _flat(dims):
    """The dims with groups replaced by their members."""
    for d in dims or ():
        yield from d.members or (d,)


@functools.lru_cache(maxsize=4096)
def parse_annotation(text: str) -> OpAnnotation:
    """Parse ``text`` (cached); raises `AnnotationError` with a caret on malformed input."""
    if not isinstance(text, str):
        raise AnnotationError(f"an annotation must be a string, got {type(text).__name__}")
    arrow = text.find("->")
    if arrow < 0:
        _fail("expected '->' between inputs and outputs", text, len(text))
    if text.find("->", arrow + 2) >= 0:
        _fail("expected a single '->'", text, text.find("->", arrow + 2))
    inputs = _parse_side(text, 0, arrow, False)
    outputs = _parse_side(text, arrow + 2, len(text), True)

    reduced, frozen, in_names, ell_name = set(), set(), set(), None
    for t in inputs + outputs:
        seen = set()
        for d in t.dims or ():
            if d.name == ELLIPSIS:
                if ELLIPSIS in seen:
                    _fail("a tensor may have at most one '...'", text, d.pos)
                if ell_name is not None and d.ellipsis_name != ell_name:
                    _fail(f"expected '{ell_name}...': all ellipses of an annotation share one "
                          "name", text, d.pos)
                ell_name = d.ellipsis_name
            frozen.update(m.name for m in d.members[1:])
            for m in d.members or (d,):
                if m.name not in ("1", ELLIPSIS) and m.name in seen:
                    _fail(f"dim {m.name!r} appears twice in one tensor", text, m.pos)
                seen.add(m.name)
                if m.marker == "+":
                    reduced.add(m.name)
                elif m.marker == "^":
                    frozen.add(m.name)
    for t in inputs:
        in_names.update(m.name for m in _flat(t.dims))
    for t in outputs:
        for d in _flat(t.dims):
            if d.name in reduced:
                _fail(f"dim {d.name!r} is marked '+' (reduced) and may not appear in an output",
                      text, d.pos)
            if d.name == ELLIPSIS and ELLIPSIS not in in_names:
                _fail("an output has '...' but no input does", text, d.pos)
            if d.name not in in_names and d.name not in ("1", ELLIPSIS) and d.name not in frozen:
                _fail(f"output dim {d.name!r} appears in no input: expected an input dim, '1', "
                      f"or a new unsplittable dim '{d.name}^'", text, d.pos)
    return OpAnnotation(text, tuple(inputs), tuple(outputs), frozenset(reduced),
                        frozenset(frozen))


@dataclass(frozen=True)
class BoundAnnotation:
    """An annotation bound to concrete shapes: every dim has a name and a size.

    ``inputs`` / ``outputs`` hold the dim names of each tensor (``"1"`` for a size-1 or broadcast
    dim, ``"(a b)"`` for a group, None for a ``?`` input); ellipses are expanded into
    ``<name>0 <name>1 ...`` (``_0 _1 ...`` for an unnamed ``...``). ``additive[i]`` tells whether
    input ``i`` is an additive input.
    """

    annotation: OpAnnotation
    inputs: Tuple[Optional[Tuple[str, ...]], ...]
    outputs: Tuple[Tuple[str, ...], ...]
    sizes: Mapping[str, int]
    reduced: frozenset
    frozen: frozenset
    additive: Tuple[bool, ...] = ()

    def __str__(self) -> str:
        def mark(d):
            if d.startswith("("):
                return "(" + " ".join(mark(m) for m in d[1:-1].split()) + ")"
            return d + ("+" if d in self.reduced else "^" if d in self.frozen else "")

        def fmt(t, add=False):
            if t is None:
                return "?"
            return ("+" if add else "") + (" ".join(mark(d) for d in t) or "1")
        return (", ".join(fmt(t, a) for t, a in zip(self.inputs, self.additive)) + " -> "
                + ", ".join(fmt(t) for t in self.outputs))

    def __repr__(self) -> str:
        return f"BoundAnnotation({str(self)!r}, sizes={dict(self.sizes)})"

    def _why_not(self, dim: str) -> Optional[str]:
        if dim == "1":
            return "'1' is a size-1 dim"
        if dim not in self.sizes:
            return f"unknown dim {dim!r}; the dims are {', '.join(self.sizes)}"
        if dim in self.frozen:
            return f"dim {dim!r} is marked '^' (may not be split)"
        if dim not in self.reduced and all(_pos(t, dim) is None for t in self.outputs):
            return f"dim {dim!r} is in no output and not marked '+' (reduced)"
        return None

    def splittable_dims(self, n: Optional[int] = None) -> List[str]:
        """Dims that may be split (size >= 2; with ``n``: into ``n`` equal pieces)."""
        return [d for d, s in self.sizes.items() if self._why_not(d) is None
                and (s >= 2 if n is None else s % n == 0 and s >= n)]

    def partition(self, dim: str, n: int) -> Tuple[List[Placement], List[Placement]]:
        """Placements of every input and output when the op is split along ``dim`` into ``n``."""
        why = self._why_not(dim)
        if why:
            raise AnnotationError(f"cannot split {self.annotation.text!r} along {dim!r}: {why}")
        if not isinstance(n, int) or n < 1 or self.sizes[dim] % n:
            raise AnnotationError(f"cannot split {self.annotation.text!r} along {dim!r}: its size "
                                  f"{self.sizes[dim]} is not divisible by n={n}")
        ins = [Shard(_pos(t, dim)) if _pos(t, dim) is not None
               else Partial() if t is not None and add and dim in self.reduced else Replicate()
               for t, add in zip(self.inputs, self.additive)]
        outs = [Shard(_pos(t, dim)) if _pos(t, dim) is not None
                else Partial() if dim in self.reduced else Replicate() for t in self.outputs]
        return ins, outs


def _pos(names: Optional[Tuple[str, ...]], dim: str) -> Optional[int]:
    """Where ``dim`` (alone, or leading a group) is in a bound tensor; None when absent."""
    for p, d in enumerate(names or ()):
        if d == dim or d.startswith("(") and d[1:-1].split()[0] == dim:
            return p
    return None


def _bind(anno: OpAnnotation, input_shapes, output_shapes) -> BoundAnnotation:
    text = anno.text
    specs = [("input", i, t) for i, t in enumerate(anno.inputs)] + \
            [("output", i, t) for i, t in enumerate(anno.outputs)]
    if len(input_shapes) != len(anno.inputs) or len(output_shapes) != len(anno.outputs):
        raise AnnotationError(
            f"annotation {text!r} has {len(anno.inputs)} input(s) and {len(anno.outputs)} "
            f"output(s), got {len(input_shapes)} input and {len(output_shapes)} output shape(s)")
    shapes = [None if s is None else tuple(int(x) for x in s)
              for s in list(input_shapes) + list(output_shapes)]

    # rank checks and ellipsis lengths
    ell_len: Dict[int, int] = {}
    for k, ((kind, i, t), shape) in enumerate(zip(specs, shapes)):
        if t.dims is None:
            continue
        if shape is None:
            raise AnnotationError(f"{kind} {i} is annotated {str(t)!r} in {text!r} "
                                  "but is not a tensor")
        n_named = sum(d.name != ELLIPSIS for d in t.dims)
        has_ell = len(t.dims) != n_named
        if shape == () and [d.name for d in t.dims] == ["1"]:
            continue
        if (has_ell and len(shape) < n_named) or (not has_ell and len(shape) != n_named):
            raise AnnotationError(
                f"{kind} {i} of {text!r} is annotated {str(t)!r} ({'at least ' if has_ell else ''}"
                f"{n_named} dims) but has shape {shape}")
        if has_ell:
            ell_len[k] = len(shape) - n_named
    total = max(ell_len.values(), default=0)
    explicit = {d.name for _, _, t in specs for d in _flat(t.dims)}
    prefix = next((d.ellipsis_name for _, _, t in specs for d in t.dims or ()
                   if d.name == ELLIPSIS), "") or "_"
    while any(f"{prefix}{j}" in explicit for j in range(total)):
        prefix += "_"
    ell_names = [f"{prefix}{j}" for j in range(total)]

    # expand, collect sizes
    named: List[Optional[List[str]]] = []
    seen: Dict[str, List[Tuple[int, int, int]]] = {}  # name -> (tensor k, position, size)
    groups: List[Tuple[int, List[str], int]] = []  # (tensor k, members, size)
    for k, ((kind, i, t), shape) in enumerate(zip(specs, shapes)):
        if t.dims is None:
            named.append(None)
            continue
        if shape == () and [d.name for d in t.dims] == ["1"]:
            named.append([])
            continue
        names: List[str] = []
        for d in t.dims:
            names.extend(ell_names[total - ell_len[k]:] if d.name == ELLIPSIS else [d.name])
        for p, (name, size) in enumerate(zip(names, shape)):
            if name.startswith("("):
                groups.append((k, name[1:-1].split(), size))
                continue
            if name == "1" and size != 1:
                raise AnnotationError(f"dim {p} of {kind} {i} of {text!r} is annotated '1' but "
                                      f"has size {size} (shape {shape})")
            seen.setdefault(name, []).append((k, p, size))
        named.append(names)

    def where(k):
        kind, i, t = specs[k]
        return f"{kind} {i} ({str(t)!r}, shape {shapes[k]})"

    sizes: Dict[str, int] = {}
    ell_set = set(ell_names)
    for name, occ in seen.items():
        if name == "1":
            continue
        full = [o for o in occ if o[2] != 1] if name in ell_set else occ
        size = full[0][2] if full else 1
        for k, p, s in occ:
            if s == size:
                continue
            if name in ell_set and s == 1 and specs[k][0] == "input":
                named[k][p] = "1"  # broadcast: this tensor holds size 1 along the dim
                continue
            k0 = full[0][0]
            raise AnnotationError(f"dim {name!r} of {text!r} has size {size} in {where(k0)} "
                                  f"but size {s} in {where(k)}")
        sizes[name] = size
    while groups:  # a group's size is the product of its members'; infer one unknown member
        k, members, size = next((g for g in groups if sum(m not in sizes for m in g[1]) <= 1),
                                groups[0])
        unknown = [m for m in members if m not in sizes]
        known = math.prod(sizes[m] for m in members if m in sizes)
        if len(unknown) > 1:
            raise AnnotationError(f"cannot tell the sizes of {', '.join(unknown)} in the group "
                                  f"({' '.join(members)}) of {where(k)}")
        if unknown and (known == 0 or size % known):
            raise AnnotationError(f"the group ({' '.join(members)}) of {where(k)} has size {size}, "
                                  f"which is not a multiple of {known}")
        if unknown:
            sizes[unknown[0]] = size // known
        elif known != size:
            raise AnnotationError(f"the group ({' '.join(members)}) of {where(k)} has size {size} "
                                  f"but its members' sizes multiply to {known}")
        groups.remove((k, members, size))
    n_in = len(anno.inputs)
    in_names = {m for t in named[:n_in] if t is not None for d in t for m in d.strip("()").split()}
    for k in range(n_in, len(specs)):
        for name in (m for d in named[k] for m in d.strip("()").split()):
            if name != "1" and name not in in_names and name not in anno.frozen:
                raise AnnotationError(f"dim {name!r} of {where(k)} appears in no input of "
                                      f"{text!r}")
    return BoundAnnotation(
        anno,
        tuple(None if t is None else tuple(t) for t in named[:n_in]),
        tuple(tuple(t) for t in named[n_in:]),
        sizes, anno.reduced, anno.frozen, tuple(t.additive for t in anno.inputs))
