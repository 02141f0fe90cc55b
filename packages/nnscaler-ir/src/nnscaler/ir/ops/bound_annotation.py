"""A parsed annotation (`OpAnnotation`, what ``parse_annotation`` in annotation.py makes of the
text) and the annotation bound to a call's shapes (`BoundAnnotation`): every dim named and sized,
what may be split, and the placements of every input and output when the op is split along a dim.
Binding is the one thing an `OpAnnotation` does, so both live here and the parser imports them."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from nnscaler.ir.layout import Partial, Placement, Replicate, Shard

from .annotation_specs import ELLIPSIS, AnnotationError, TensorSpec, _flat

__all__ = ["OpAnnotation", "BoundAnnotation"]


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
             output_shapes: Sequence[Optional[Sequence[int]]]) -> BoundAnnotation:
        """Bind to the shapes of the tensor inputs/outputs (None for a ``?`` / non-tensor entry)."""
        return _bind(self, input_shapes, output_shapes)


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
