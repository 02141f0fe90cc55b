"""Dimension annotations of the torch operators that transformers, MLPs and small CNNs use.
(Long because it is one table, one short entry per operator.)

Entries follow the registry's convention: one entry per *tensor* argument, in order of
appearance in the flattened ``(args, kwargs)`` (python numbers, None, shapes are not entries);
so ``x + 2`` has one input entry and ``x + y`` two. Most annotations depend on the arguments
(which dim, keepdim, bias or not, ...) and are computed per call by the functions below; one that
cannot handle a call returns None (or raises), and the call then runs replicated.

``view``/``reshape``/``expand`` spell their output shape: a piece of a partitioned one must be
called with its local output shape (`localize_args`).
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F

from nnscaler.ir.tree import tensor_leaves

__all__ = ["register_builtins", "localize_args"]

_T = torch.Tensor


_tensors = tensor_leaves


def _call(params: Sequence[str], args: tuple, kwargs: dict):
    """Name a call's arguments: (value by parameter name, [(name, value)] in call order)."""
    if len(args) > len(params):
        raise TypeError("too many positional arguments")
    ordered = list(zip(params, args)) + list(kwargs.items())
    return dict(ordered), ordered


def _anno(ordered, specs: Dict[str, object], outputs: Sequence[str]) -> str:
    """Join the entries of the tensors of ``ordered`` (unlisted tensors are ``?``) and outputs."""
    ins: List[str] = []
    for name, value in ordered:
        leaves = _tensors(value)
        spec = specs.get(name, "?")
        entries = list(spec) if isinstance(spec, (list, tuple)) else [spec] * len(leaves)
        if len(entries) != len(leaves):
            raise ValueError(f"{len(leaves)} tensors for {len(entries)} entries")
        ins.extend(entries)
    return f"{', '.join(ins)} -> {', '.join(outputs)}"


def _j(tokens: Sequence[str]) -> str:
    return " ".join(tokens) or "1"


def _norm(dim: int, ndim: int) -> int:
    if not -ndim <= dim < max(ndim, 1):
        raise IndexError(dim)
    return dim % max(ndim, 1)


# ---------------------------------------------------------------- elementwise
def _elementwise(*args, **kwargs) -> Optional[str]:
    """Any number of tensors broadcast together: ``..., ... -> ...``."""
    n = len(_tensors((args, kwargs)))
    if n == 0 or "out" in kwargs:
        return None
    return ", ".join(["..."] * n) + " -> ..."


def _first_only(*args, **kwargs) -> Optional[str]:
    """Elementwise on the first tensor; the others give only a dtype/device (``to``)."""
    n = len(_tensors((args, kwargs)))
    return ", ".join(["..."] + ["?"] * (n - 1)) + " -> ..." if n else None


def _type(x, dtype=None, non_blocking=False, **kwargs):
    """``x.type(torch.float64)`` converts like ``to`` (HF GPT-2's attention does it to the
    softmax); ``x.type()`` returns a string, no tensor."""
    return None if dtype is None else "... -> ..."


def _where(*args, **kwargs):
    return None if len(args) + len(kwargs) == 1 else _elementwise(*args, **kwargs)


# ---------------------------------------------------------------- contractions
def _linear(*args, **kwargs):
    v, ordered = _call(("input", "weight", "bias"), args, kwargs)
    if v["weight"].dim() != 2:
        return None
    return _anno(ordered, {"input": "b... k+", "weight": "n k+", "bias": "+n"}, ["b... n"])


def _addmm(*args, **kwargs):
    """``beta * input + alpha * (mat1 @ mat2)`` (HF GPT-2's Conv1D: ``addmm(bias, x, W)``): the
    added input is additive (value-split with the products when ``k`` is split)."""
    if "out" in kwargs:
        return None
    v, ordered = _call(("input", "mat1", "mat2", "beta", "alpha"), args, kwargs)
    bias, m1, m2 = v["input"], v["mat1"], v["mat2"]
    if m1.dim() != 2 or m2.dim() != 2 or not isinstance(bias, torch.Tensor) or bias.dim() > 2:
        return None
    m, n = m1.shape[0], m2.shape[1]
    names = [("m", m), ("n", n)][2 - bias.dim():]
    spec = _j(["1" if size == 1 and full != 1 else name for (name, full), size in zip(names, bias.shape)])
    return _anno(ordered, {"input": "+" + spec, "mat1": "m k+", "mat2": "k+ n"}, ["m n"])


def _matmul(*args, reverse=False, **kwargs):
    if "out" in kwargs:
        return None
    v, ordered = _call(("input", "other"), args, kwargs)
    a, b = (v["other"], v["input"]) if reverse else (v["input"], v["other"])
    sa = "k+" if a.dim() == 1 else "... m k+"
    sb = "k+" if b.dim() == 1 else "... k+ n"
    out = _j([t for t, d in (("...", a.dim() > 1 or b.dim() > 1), ("m", a.dim() > 1),
                             ("n", b.dim() > 1)) if d])
    specs = {"input": sb, "other": sa} if reverse else {"input": sa, "other": sb}
    return _anno(ordered, specs, [out])


def _einsum(equation, *operands, **kwargs):
    if not isinstance(equation, str) or kwargs:
        return None
    eq = equation.replace(" ", "")
    lhs, rhs = eq.split("->") if "->" in eq else (eq, None)
    letters = [c for c in lhs if c.isalpha()]
    if rhs is None:  # implicit output: ellipsis, then letters used once, sorted
        rhs = ("..." if "..." in lhs else "") + "".join(
            sorted(c for c in set(letters) if letters.count(c) == 1))
    out_letters = set(rhs)

    def conv(term: str, is_out: bool) -> str:
        toks, i = [], 0
        while i < len(term):
            if term.startswith("...", i):
                toks.append("...")
                i += 3
                continue
            c = term[i]
            if not c.isalpha() or c in term[:i]:
                raise ValueError(f"unsupported einsum term {term!r}")  # e.g. a diagonal
            toks.append(c + ("+" if not is_out and c not in out_letters else ""))
            i += 1
        return _j(toks)

    terms = lhs.split(",")
    if len(terms) != len(_tensors(operands)):
        return None
    return ", ".join(conv(t, False) for t in terms) + " -> " + conv(rhs, True)


# ---------------------------------------------------------------- normalisation, softmax
def _dims(ndim: int, marks: Optional[Dict[int, str]] = None) -> List[str]:
    """``d0 d1 ...`` with ``marks[i]`` appended to dim ``i``."""
    return [f"d{i}{(marks or {}).get(i, '')}" for i in range(ndim)]


def _softmax_like(params):
    def anno(*args, **kwargs):
        v, ordered = _call(params, args, kwargs)
        x, dim = v["input"], v.get("dim")
        if dim is None or x.dim() == 0:
            return None
        spec = _j(_dims(x.dim(), {_norm(dim, x.dim()): "^"}))
        return _anno(ordered, {"input": spec}, [spec])
    return anno


def _norm_layer(params):
    def anno(*args, **kwargs):
        v, ordered = _call(params, args, kwargs)
        shape = v["normalized_shape"]
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        norm = " ".join(f"n{i}^" for i in range(len(shape)))
        specs = {"input": f"... {norm}", "weight": norm, "bias": norm}
        return _anno(ordered, specs, [f"... {norm}"])
    return anno


def _embedding(*args, **kwargs):
    v, ordered = _call(("input", "weight", "padding_idx", "max_norm"), args, kwargs)
    if v.get("max_norm") is not None:  # renormalises the weight in place
        return None
    return _anno(ordered, {"input": "...", "weight": "v^ h"}, ["... h"])


# ---------------------------------------------------------------- shape ops
def _reshape_anno(in_shape: Sequence[int], out_shape: Sequence[int]) -> str:
    """Align the dims of both shapes into groups of equal size (size-1 dims aside): a dim kept as
    it is keeps its name, a dim split into several or merged from several becomes a group whose
    first member may be split (``b s (h d) -> b s h d^``); a many-to-many group is ``^``."""
    numel = math.prod(in_shape)
    out = list(out_shape)
    if out.count(-1) == 1:
        out[out.index(-1)] = numel // math.prod(s for s in out if s != -1)
    if math.prod(out) != numel or numel == 0 or any(s < 0 for s in out):
        raise ValueError("cannot reshape")
    ins = [(p, x) for p, x in enumerate(in_shape) if x != 1]
    outs = [(p, x) for p, x in enumerate(out) if x != 1]
    in_tok, out_tok = ["1"] * len(in_shape), ["1"] * len(out)
    a = b = g = 0
    while a < len(ins):
        ga, gb = [ins[a]], [outs[b]]
        a, b = a + 1, b + 1
        while math.prod(x for _, x in ga) != math.prod(x for _, x in gb):
            if math.prod(x for _, x in ga) < math.prod(x for _, x in gb):
                ga, a = ga + [ins[a]], a + 1
            else:
                gb, b = gb + [outs[b]], b + 1
        if len(ga) == 1 or len(gb) == 1:
            many, one = (gb, ga) if len(ga) == 1 else (ga, gb)
            names = [f"d{g}"] + [f"d{g}_{m}^" for m in range(1, len(many))]
            many_tok, one_tok = (out_tok, in_tok) if len(ga) == 1 else (in_tok, out_tok)
            for (p, _), name in zip(many, names):
                many_tok[p] = name
            one_tok[one[0][0]] = names[0] if len(names) == 1 else f"({' '.join(names)})"
        else:
            for m, (p, _) in enumerate(ga):
                in_tok[p] = f"d{g}_i{m}^"
            for m, (p, _) in enumerate(gb):
                out_tok[p] = f"d{g}_o{m}^"
        g += 1
    return f"{_j(in_tok)} -> {_j(out_tok)}"


def _shape_arg(shape, kwargs):
    shape = kwargs.get("size", kwargs.get("shape", shape))
    if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
        shape = shape[0]
    return [int(s) for s in shape]


def _view(x, *shape, **kwargs):
    return _reshape_anno(x.shape, _shape_arg(shape, kwargs))


def _flatten(x, start_dim=0, end_dim=-1):
    if x.dim() == 0:
        return "1 -> 1"
    a, b = _norm(start_dim, x.dim()), _norm(end_dim, x.dim())
    shape = list(x.shape)
    return _reshape_anno(shape, shape[:a] + [math.prod(shape[a:b + 1])] + shape[b + 1:])


def _unsqueeze(x, dim):
    names = _dims(x.dim())
    names.insert(_norm(dim, x.dim() + 1), "1")
    return f"{_j(_dims(x.dim()))} -> {_j(names)}"


def _squeeze(x, dim=None):
    nd = x.dim()
    dims = range(nd) if dim is None else [_norm(d, nd) for d in (
        dim if isinstance(dim, (tuple, list)) else [dim])]
    drop = {d for d in dims if nd and x.shape[d] == 1}
    ins = ["1" if i in drop else n for i, n in enumerate(_dims(nd))]
    return f"{_j(ins)} -> {_j([n for n in ins if n != '1'] if drop else ins)}"


def _transpose(x, dim0, dim1):
    names = _dims(x.dim())
    a, b = _norm(dim0, x.dim()), _norm(dim1, x.dim())
    out = list(names)
    out[a], out[b] = names[b], names[a]
    return f"{_j(names)} -> {_j(out)}"


def _t(x):
    return _transpose(x, 0, 1) if x.dim() == 2 else f"{_j(_dims(x.dim()))} -> {_j(_dims(x.dim()))}"


def _permute(x, *dims, **kwargs):
    dims = kwargs.get("dims", dims)
    if len(dims) == 1 and isinstance(dims[0], (tuple, list)):
        dims = dims[0]
    names = _dims(x.dim())
    return f"{_j(names)} -> {_j([names[_norm(d, x.dim())] for d in dims])}"


def _getitem(x, index):
    """Basic indexing (ints, slices, ``...``, None): fully kept dims keep their names."""
    idx = list(index) if isinstance(index, tuple) else [index]
    if not all(i is None or i is Ellipsis or isinstance(i, slice)
               or isinstance(i, int) and not isinstance(i, bool) for i in idx):
        return None  # advanced (tensor / list / bool) indexing
    used = sum(i is not None and i is not Ellipsis for i in idx)
    if used > x.dim() or idx.count(Ellipsis) > 1:
        return None
    fill = [slice(None)] * (x.dim() - used)
    idx = (idx[:idx.index(Ellipsis)] + fill + idx[idx.index(Ellipsis) + 1:]
           if Ellipsis in idx else idx + fill)
    ins, out, p = _dims(x.dim()), [], 0
    for i in idx:
        if i is None:
            out.append("1")
            continue
        size = x.shape[p]
        if isinstance(i, slice) and i.indices(size) == (0, size, 1):
            out.append(ins[p])
        else:
            ins[p] += "^"
            if isinstance(i, slice):
                out.append(f"g{p}^")
        p += 1
    return f"{_j(ins)} -> {_j(out)}"


def _expand_to(x, shape):
    """(input dims, output dims) of expanding ``x`` to ``shape``; new or grown dims are ``e<i>``."""
    shape = list(shape)
    lead = len(shape) - x.dim()
    if lead < 0:
        raise ValueError("expand to fewer dims")
    ins, out = _dims(x.dim()), [f"e{i}" for i in range(lead)]
    for p, size in enumerate(x.shape):
        if shape[lead + p] in (-1, size):
            out.append(ins[p])
        else:
            ins[p] = "1"
            out.append(f"e{lead + p}")
    return ins, out


def _expand(x, *sizes, **kwargs):
    ins, out = _expand_to(x, _shape_arg(sizes, kwargs))
    return f"{_j(ins)} -> {_j([d + '^' if d[0] == 'e' else d for d in out])}"


def _expand_as(x, other):
    """``other`` only gives the shape, so it is annotated like the output: a piece of the output
    comes from the matching piece of ``other``."""
    ins, out = _expand_to(x, other.shape)
    return f"{_j(ins)}, {_j(out)} -> {_j(out)}"


def _triangle(input, diagonal=0):
    return "... r^ c^ -> ... r^ c^" if input.dim() >= 2 else None


def _pieces(x, sizes, dim):
    """A tensor cut along ``dim`` into pieces of ``sizes``; the cut dim is new in each piece."""
    nd = x.dim()
    d = _norm(dim, nd)
    ins = _dims(nd, {d: "^"})
    outs = [_j(ins[:d] + [f"c{j}^"] + ins[d + 1:]) for j in range(len(sizes))]
    return f"{_j(ins)} -> {', '.join(outs)}"


def _split(tensor, split_size_or_sections=None, dim=0, split_size=None):
    split_size_or_sections = split_size if split_size is not None else split_size_or_sections
    size = tensor.shape[_norm(dim, tensor.dim())]
    if isinstance(split_size_or_sections, int):
        k = split_size_or_sections
        sizes = [k] * (size // k) + ([size % k] if size % k else [])
    else:
        sizes = list(split_size_or_sections)
    return _pieces(tensor, sizes, dim)


def _chunk(input, chunks, dim=0):
    size = input.shape[_norm(dim, input.dim())]
    step = -(-size // chunks)
    return _pieces(input, [step] * (-(-size // step)), dim)


def _unbind(input, dim=0):
    nd = input.dim()
    d = _norm(dim, nd)
    names = _dims(nd, {d: "^"})
    out = _j(names[:d] + names[d + 1:])
    return f"{_j(names)} -> {', '.join([out] * input.shape[d])}"


def _cat(tensors, dim=0, axis=None):
    dim = dim if axis is None else axis
    nd = tensors[0].dim()
    d = _norm(dim, nd)
    ins = [_j(_dims(nd)[:d] + [f"c{j}^"] + _dims(nd)[d + 1:]) for j in range(len(tensors))]
    return f"{', '.join(ins)} -> {_j(_dims(nd)[:d] + ['c^'] + _dims(nd)[d + 1:])}"


def _stack(tensors, dim=0):
    names = _dims(tensors[0].dim())
    out = list(names)
    out.insert(_norm(dim, len(names) + 1), "s^")
    return f"{', '.join([_j(names)] * len(tensors))} -> {_j(out)}"


# ---------------------------------------------------------------- reductions, losses
def _reduction(mark):
    def anno(*args, **kwargs):
        v, ordered = _call(("input", "dim", "keepdim", "dtype"), args, kwargs)
        x, dim, keep = v["input"], v.get("dim"), bool(v.get("keepdim", False))
        nd = x.dim()
        dims = range(nd) if dim is None or dim == [] or dim == () else [
            _norm(d, nd) for d in (dim if isinstance(dim, (tuple, list)) else [dim])]
        red = set(dims) if nd else set()
        ins = _dims(nd, {d: mark for d in red})
        out = [("1" if keep else None) if i in red else n for i, n in enumerate(_dims(nd))]
        return _anno(ordered, {"input": _j(ins)}, [_j([o for o in out if o])])
    return anno


def _loss_marks(reduction: str):
    """(mark of the reduced dims, output) for a loss ``reduction``: a mean is not a sum of
    partial means, so only ``sum`` may be split along the reduced dims."""
    return {"none": ("", None), "sum": ("+", "1"), "mean": ("^", "1")}[reduction]


def _cross_entropy(*args, **kwargs):
    v, ordered = _call(("input", "target", "weight", "size_average", "ignore_index", "reduce",
                        "reduction", "label_smoothing"), args, kwargs)
    x, target = v["input"], v["target"]
    if x.dim() < 2 or v.get("size_average") is not None or v.get("reduce") is not None:
        return None
    mark, out = _loss_marks(v.get("reduction", "mean"))
    n, space = f"n{mark}", [f"s{i}{mark}" for i in range(x.dim() - 2)]
    probs = target.dim() == x.dim()
    specs = {"input": _j([n, "c^"] + space), "weight": "c^",
             "target": _j([n] + (["c^"] if probs else []) + space)}
    return _anno(ordered, specs, [out or _j([n] + space)])


def _mse_loss(*args, **kwargs):
    v, ordered = _call(("input", "target", "size_average", "reduce", "reduction", "weight"),
                       args, kwargs)
    x, y = v["input"], v["target"]
    if x.shape != y.shape or v.get("weight") is not None or v.get("size_average") is not None \
            or v.get("reduce") is not None:
        return None
    mark, out = _loss_marks(v.get("reduction", "mean"))
    spec = _j(_dims(x.dim(), {i: mark for i in range(x.dim())})) if out else "..."
    return _anno(ordered, {"input": spec, "target": spec}, [out or "..."])


# ---------------------------------------------------------------- attention, conv, pooling
def _batch_norm(*args, **kwargs):
    v, ordered = _call(("input", "running_mean", "running_var", "weight", "bias", "training",
                        "momentum", "eps"), args, kwargs)
    x = v["input"]
    rest = ["n"] + [f"h{i}" for i in range(x.dim() - 2)]  # batch statistics: n, h.. are reduced
    # never split n, h.. (also when traced in eval mode with running statistics): the generated code
    # passes `training=self.training`, and a module traced in eval may train, where a split batch
    # would normalise each piece with its own statistics (a silently different result)
    marks = "^"
    spec = _j([rest[0] + marks, "c"] + [h + marks for h in rest[1:]])
    return _anno(ordered, {"input": spec, "running_mean": "c", "running_var": "c",
                           "weight": "c", "bias": "c"}, [spec])


def _sdpa(*args, **kwargs):
    v, ordered = _call(("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
                        "enable_gqa"), args, kwargs)
    s = "s^" if v.get("is_causal") else "s"  # a causal mask is laid out on the full sequence
    mask = v.get("attn_mask")
    if v.get("enable_gqa"):
        return _sdpa_gqa(ordered, v["query"], v["key"], mask, s)
    specs = {"query": f"... {s} d^", "key": "... t^ d^", "value": "... t^ e"}
    if isinstance(mask, torch.Tensor):
        last = ["1" if mask.shape[-1] == 1 else "t^"]
        if mask.dim() >= 2:
            last.insert(0, "1" if mask.shape[-2] == 1 else s)
        specs["attn_mask"] = _j((["..."] if mask.dim() > 2 else []) + last)
    return _anno(ordered, specs, [f"... {s} e"])


def _sdpa_gqa(ordered, q, k, mask, s):
    """Grouped-query attention: q has ``h * g`` heads, k / v have ``h``; q's head ``i`` reads kv
    head ``i // g``. Splitting ``h`` splits q's heads and k/v's kv-heads consistently (both
    counts divisible by the degree)."""
    if q.dim() < 3 or k.dim() != q.dim() or q.shape[-3] % k.shape[-3]:
        return None
    heads = "h" if q.shape[-3] == k.shape[-3] else "(h g^)"
    specs = {"query": f"... {heads} {s} d^", "key": "... h t^ d^", "value": "... h t^ e"}
    if isinstance(mask, torch.Tensor):
        last = ["1" if mask.shape[-1] == 1 else "t^"]
        if mask.dim() >= 2:
            last.insert(0, "1" if mask.shape[-2] == 1 else s)
        if mask.dim() >= 3:
            last.insert(0, "1" if mask.shape[-3] == 1 else heads)
        specs["attn_mask"] = _j((["..."] if mask.dim() > 3 else []) + last)
    return _anno(ordered, specs, [f"... {heads} {s} e"])


def _conv(*args, **kwargs):
    v, ordered = _call(("input", "weight", "bias", "stride", "padding", "dilation", "groups"),
                       args, kwargs)
    x, w = v["input"], v["weight"]
    k = w.dim() - 2
    grouped = v.get("groups", 1) != 1
    c, o = ("c^", "o^") if grouped else ("c+", "o")
    batch = ["n"] if x.dim() == k + 2 else []
    specs = {"input": _j(batch + [c] + [f"h{i}^" for i in range(k)]),
             "weight": _j([o, "g^" if grouped else c] + [f"k{i}^" for i in range(k)]),
             "bias": ("+" if not grouped else "") + o}
    return _anno(ordered, specs, [_j(batch + [o] + [f"q{i}^" for i in range(k)])])


def _pool(k: int, indices_at: Optional[int] = None, always_indices: bool = False):
    """Pooling over the last ``k`` dims; ``indices_at``: the position of ``return_indices`` in the
    arguments after the input."""
    def anno(input, *args, **kwargs):
        out = "... " + " ".join(f"q{i}^" for i in range(k))
        ret = always_indices or indices_at is not None and (
            kwargs.get("return_indices", False)
            or len(args) > indices_at and bool(args[indices_at]))
        return f"... {' '.join(f'h{i}^' for i in range(k))} -> " + (f"{out}, {out}" if ret
                                                                      else out)
    return anno


def localize_args(fn, args: tuple, kwargs: dict, output_shapes: Sequence[Sequence[int]]):
    """The arguments with which one piece of a partitioned call runs: ``view``/``reshape``/
    ``expand`` spell their output shape, so a piece gets its own (local) output shape; other calls
    are unchanged.
    """
    if fn in (_T.view, _T.reshape, torch.reshape, _T.expand) and output_shapes:
        return (_tensors((args, kwargs))[0], tuple(output_shapes[0])), {}
    return args, kwargs


# ---------------------------------------------------------------- the table
_ELEMENTWISE = {
    torch.Tensor: ["__add__", "__radd__", "__sub__", "__rsub__", "__mul__",
                   "__rmul__", "__truediv__", "__rtruediv__", "__rdiv__", "__div__", "__pow__",
                   "__rpow__", "__neg__", "__floordiv__", "__mod__", "__eq__", "__ne__", "__lt__",
                   "__le__", "__gt__", "__ge__", "__and__", "__or__", "__invert__",
                   "add", "sub", "mul", "div", "pow", "neg", "exp", "sqrt", "rsqrt", "abs",
                   "log", "sin", "cos", "reciprocal", "square", "clamp", "masked_fill",
                   "relu", "tanh", "sigmoid", "contiguous", "clone", "detach", "float", "half",
                   "bfloat16", "double", "eq", "ne", "lt", "le", "gt", "ge"],
    torch: ["add", "sub", "mul", "div", "pow", "neg", "exp", "sqrt", "rsqrt", "abs", "log",
            "sin", "cos", "reciprocal", "square", "clamp", "masked_fill", "relu", "tanh",
            "sigmoid", "maximum", "minimum", "eq", "ne", "lt", "le", "gt", "ge"],
    F: ["gelu", "silu", "relu", "tanh", "sigmoid", "dropout", "leaky_relu", "elu", "softplus",
        "mish", "relu6", "hardtanh"],
}


# In-place elementwise methods (a residual ``x += y`` in ResNet, ``x.mul_(s)``; ``copy_``: DeepSeek-V3's
# attention fills slices of a ``new_empty`` key): the result is the first tensor, which broadcasting may
# not grow. Split with its target, the write lands in the target's own piece (replicated, it would
# land in a gathered copy of it and be lost).
_INPLACE_ELEMENTWISE = ["__iadd__", "__isub__", "__imul__", "__itruediv__", "add_", "sub_", "mul_",
                        "div_", "copy_"]


def _inplace_elementwise(*args, **kwargs) -> Optional[str]:
    ts = _tensors((args, kwargs))
    if not ts or "out" in kwargs or any(t.dim() > ts[0].dim() for t in ts[1:]):
        return None
    return _elementwise(*args, **kwargs)


def register_builtins(registry) -> None:
    """Register the annotations of the built-in torch ops in ``registry``."""
    def reg(ns, names, anno):
        prefix = {torch.Tensor: "torch.Tensor", torch: "torch", F: "torch.nn.functional"}[ns]
        for n in names if isinstance(names, list) else [names]:
            if hasattr(ns, n):
                registry.register(getattr(ns, n), anno, f"{prefix}.{n}")

    for ns, names in _ELEMENTWISE.items():
        reg(ns, names, _elementwise)
    reg(torch, "where", _where)
    reg(torch.Tensor, ["to", "type_as"], _first_only)
    reg(torch.Tensor, "type", _type)
    reg(F, "linear", _linear)
    for ns in (torch, torch.Tensor):
        reg(ns, "addmm", _addmm)
    reg(torch.Tensor, _INPLACE_ELEMENTWISE, _inplace_elementwise)
    for ns in (torch, torch.Tensor):
        reg(ns, "matmul", _matmul)
        reg(ns, "mm", lambda *a, **k: None if "out" in k else "m k+, k+ n -> m n")
        reg(ns, "bmm", lambda *a, **k: None if "out" in k else "b m k+, b k+ n -> b m n")
        reg(ns, "softmax", _softmax_like(("input", "dim", "dtype")))
        reg(ns, "log_softmax", _softmax_like(("input", "dim", "dtype")))
        reg(ns, ["view", "reshape"], _view)
        reg(ns, "flatten", _flatten)
        reg(ns, "unsqueeze", _unsqueeze)
        reg(ns, "squeeze", _squeeze)
        reg(ns, "transpose", _transpose)
        reg(ns, "t", _t)
        reg(ns, "permute", _permute)
        reg(ns, "split", _split)
        reg(ns, "chunk", _chunk)
        reg(ns, "unbind", _unbind)
        reg(ns, "sum", _reduction("+"))
        reg(ns, "mean", _reduction("^"))
    reg(torch.Tensor, "__matmul__", _matmul)
    reg(torch.Tensor, "__rmatmul__", lambda *a, **k: _matmul(*a, reverse=True, **k))
    reg(torch, "einsum", _einsum)
    reg(F, ["softmax", "log_softmax"], _softmax_like(("input", "dim", "_stacklevel", "dtype")))
    reg(F, "layer_norm", _norm_layer(("input", "normalized_shape", "weight", "bias", "eps")))
    reg(F, "rms_norm", _norm_layer(("input", "normalized_shape", "weight", "eps")))
    reg(F, "embedding", _embedding)
    reg(F, "batch_norm", _batch_norm)
    reg(torch.Tensor, "__getitem__", _getitem)
    reg(torch.Tensor, "expand", _expand)
    reg(torch.Tensor, "expand_as", _expand_as)
    reg(torch, "outer", lambda *a, **k: None if "out" in k else "a, b -> a b")
    for ns in (torch, torch.Tensor):
        reg(ns, ["triu", "tril"], _triangle)
    reg(torch, ["cat", "concat", "concatenate"], _cat)
    reg(torch, "stack", _stack)
    reg(F, "cross_entropy", _cross_entropy)
    reg(F, "mse_loss", _mse_loss)
    reg(F, "scaled_dot_product_attention", _sdpa)
    reg(torch, ["conv1d", "conv2d", "conv3d"], _conv)
    for k in (1, 2, 3):
        reg(F, [f"avg_pool{k}d", f"adaptive_avg_pool{k}d"], _pool(k))
        reg(F, f"max_pool{k}d", _pool(k, indices_at=5))
        reg(F, f"adaptive_max_pool{k}d", _pool(k, indices_at=1))
        reg(F, [f"max_pool{k}d_with_indices", f"adaptive_max_pool{k}d_with_indices"],
            _pool(k, always_indices=True))
