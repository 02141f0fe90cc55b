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
import re
from typing import List

from .annotation_specs import ELLIPSIS, AnnotationError, DimSpec, TensorSpec, _flat
from .bound_annotation import BoundAnnotation, OpAnnotation

__all__ = ["AnnotationError", "DimSpec", "TensorSpec", "OpAnnotation", "BoundAnnotation",
           "parse_annotation"]

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


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
