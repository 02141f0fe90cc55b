"""The op registry, register_op, and — most important — that every built-in annotation is right:
splitting an op along any splittable dim, running it on the pieces and combining the results per
the output placements reproduces the full output."""
import functools

import pytest
import torch
import torch.nn.functional as F

from nnscaler.ir.ops import builtin_ops
from nnscaler.ir.tracer import tracing_context
from nnscaler.ir.ops.annotation import AnnotationError, parse_annotation
from nnscaler.ir.layout import Partial, Shard, TensorLayout
from nnscaler.ir.ops.registry import REGISTRY, OpRegistry, register_op, tensor_leaves

T = torch.Tensor
torch.manual_seed(0)


# ------------------------------------------------------------------ the generic checker
def replace_tensors(obj, new):
    """``obj`` with its tensors (in annotation-entry order) replaced by the items of ``new``."""
    it = iter(new)

    def walk(x):
        if isinstance(x, torch.Tensor):
            return next(it)
        if isinstance(x, (list, tuple)):
            return type(x)(walk(y) for y in x)
        if isinstance(x, dict):
            return {k: walk(y) for k, y in x.items()}
        return x
    return walk(obj)


def piece(t, placement, n, i):
    if isinstance(placement, Partial):
        return t.clone() if i == 0 else torch.zeros_like(t)
    lay = TensorLayout(tuple(t.shape), placement, n, i)
    return t[tuple(slice(a, b) for a, b in lay.slices())].clone()


def combine(pieces, placement, full):
    if isinstance(placement, Shard):
        return torch.cat(pieces, dim=placement.dim)
    if isinstance(placement, Partial):
        return functools.reduce(torch.add, pieces)
    for p in pieces:
        assert_same(p, full)
    return pieces[0]


def assert_same(got, want):
    assert got.shape == want.shape
    if want.is_floating_point():
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    else:
        assert torch.equal(got, want)


def check_partitions(fn, args, kwargs=None, n=2):
    """Split ``fn(*args, **kwargs)`` along every splittable dim into ``n`` pieces per its
    annotation, run it on the pieces, and check the combined outputs equal the full ones.
    Returns the bound annotation and the dims that were checked."""
    kwargs = kwargs or {}
    text = REGISTRY.lookup(fn, args, kwargs)
    assert text is not None, f"{REGISTRY.name_of(fn)} has no annotation for this call"
    ins = tensor_leaves((args, kwargs))
    a0, k0 = replace_tensors((args, kwargs), [t.clone() for t in ins])
    full = tensor_leaves(fn(*a0, **k0))
    bound = parse_annotation(text).bind([tuple(t.shape) for t in ins],
                                        [tuple(t.shape) for t in full])
    dims = bound.splittable_dims(n)
    for dim in dims:
        in_pl, out_pl = bound.partition(dim, n)
        results = []
        for i in range(n):
            local = [piece(t, p, n, i) for t, p in zip(ins, in_pl)]
            a, k = replace_tensors((args, kwargs), local)
            out_shapes = [TensorLayout(tuple(t.shape), p, n, i).local_shape()
                          if not isinstance(p, Partial) else tuple(t.shape)
                          for t, p in zip(full, out_pl)]
            a, k = builtin_ops.localize_args(fn, a, k, out_shapes)
            results.append(tensor_leaves(fn(*a, **k)))
        for j, (want, p) in enumerate(zip(full, out_pl)):
            try:
                assert_same(combine([r[j] for r in results], p, want), want)
            except AssertionError as e:
                raise AssertionError(f"{REGISTRY.name_of(fn)} {bound} split along {dim!r}: "
                                     f"output {j} ({p!r}) is wrong") from e
    return bound, dims


# ------------------------------------------------------------------ representative calls
def r(*shape):
    return torch.rand(*shape, dtype=torch.float64) + 0.5


x3 = r(4, 6, 8)
img = r(2, 4, 6, 6)
CASES = []  # (id, fn, args, kwargs, dims that must be splittable (n=2))


def case(fn, args, kwargs=None, dims=(), id=None):
    CASES.append((id or REGISTRY.name_of(fn), fn, args, kwargs or {}, set(dims)))


w, b = r(10, 8), r(10)
case(F.linear, (x3, w), dims={"b0", "b1", "k", "n"})
case(F.linear, (x3, w, b), dims={"b0", "b1", "k", "n"}, id="linear+bias")
case(F.linear, (x3,), dict(bias=b, weight=w), dims={"k", "n"}, id="linear-kwargs")
case(F.linear, (r(8), w, b), dims={"k", "n"}, id="linear-1d")
for fn in (torch.matmul, T.matmul, T.__matmul__):
    case(fn, (x3, r(8, 4)), dims={"_0", "m", "k", "n"})
case(torch.matmul, (r(2, 1, 4, 6), r(4, 6, 8)), dims={"_0", "_1", "m", "k", "n"}, id="matmul-bcast")
case(torch.matmul, (r(6), r(2, 6, 4)), dims={"k", "n", "_0"}, id="matmul-vec-mat")
case(torch.matmul, (r(2, 4, 6), r(6)), dims={"k", "m", "_0"}, id="matmul-mat-vec")
case(torch.matmul, (r(6), r(6)), dims={"k"}, id="matmul-dot")
case(T.__rmatmul__, (r(8, 4), x3), dims={"m", "k", "n"})
case(torch.mm, (r(4, 6), r(6, 8)), dims={"m", "k", "n"})
case(torch.bmm, (r(2, 4, 6), r(2, 6, 8)), dims={"b", "m", "k", "n"})
case(torch.einsum, ("bhqd,bhkd->bhqk", r(2, 4, 6, 8), r(2, 4, 10, 8)), dims="bhqdk")
case(torch.einsum, ("ij,jk", r(4, 6), r(6, 8)), dims="ijk", id="einsum-implicit")
case(torch.einsum, ("...ij,...jk->...ik", [r(2, 4, 6), r(2, 6, 8)]), dims={"_0", "i", "j"},
     id="einsum-list")
case(torch.einsum, ("ij,i->i", r(4, 6), r(4)), dims="ij", id="einsum-multiplicative")

# elementwise: every registered elementwise op, with broadcasting (4,1,6) op (2,6)
xb, yb, mask = r(4, 1, 6), r(2, 6), torch.rand(2, 6) > 0.5
for ns, names in builtin_ops._ELEMENTWISE.items():
    for name in names:
        fn = getattr(ns, name, None)
        if fn is None:
            continue
        kw = {"p": 0.5, "training": False} if name == "dropout" else {}
        for args in [(xb, yb), (xb,), (xb > 1, mask), (xb > 1,), (xb, mask, 0.25)]:
            try:
                if not isinstance(fn(*args, **kw), torch.Tensor):
                    continue
            except Exception:
                continue
            case(fn, args, kw, id=f"{REGISTRY.name_of(fn)}{len(args)}")
            break
case(torch.add, (x3, 2.0), dict(alpha=3), dims={"_0", "_1", "_2"}, id="add-scalar")
case(T.__radd__, (x3, 2.0), dims={"_0", "_1", "_2"})
case(torch.where, (mask, xb, yb), dims={"_0", "_1", "_2"})
case(torch.where, (mask, xb, 0.0), id="where-scalar")
case(T.masked_fill, (x3, torch.rand(6, 8) > 0.5, torch.tensor(2.0, dtype=torch.float64)),
     id="masked_fill-tensor")
case(T.to, (x3, torch.zeros(2, dtype=torch.float32)), dims={"_0", "_1", "_2"})
case(T.type_as, (x3, torch.zeros(2, dtype=torch.float32)), dims={"_0"})

for fn in (F.softmax, F.log_softmax, torch.softmax, torch.log_softmax, T.softmax,
           T.log_softmax):
    case(fn, (x3,), dict(dim=1), dims={"d0", "d2"}, id=f"{REGISTRY.name_of(fn)}-dim1")
    case(fn, (x3, -1), dims={"d0", "d1"})
case(F.layer_norm, (x3, (8,), r(8), r(8)), dims={"_0", "_1"})
case(F.layer_norm, (x3, [6, 8]), dict(weight=r(6, 8)), dims={"_0"}, id="layer_norm-2d")
case(F.rms_norm, (x3, (8,)), dict(weight=r(8), eps=1e-6), dims={"_0", "_1"})
case(F.embedding, (torch.randint(0, 10, (4, 6)), r(10, 8)), dims={"_0", "_1", "h"})

for fn in (T.view, T.reshape):
    case(fn, (x3, 4, 6, 2, 4), dims={"d0", "d1", "d2"})  # d2: the heads of (h d)
    case(fn, (x3, (-1, 8)), dims={"d0", "d1"}, id=f"{REGISTRY.name_of(fn)}-merge")
case(torch.reshape, (x3, (4, 48)), dims={"d0", "d1"})
case(T.view, (r(4, 6, 2, 4), 4, 6, 8), dims={"d0", "d1", "d2"}, id="view-merge-heads")
case(T.view, (x3, 4, 1, 6, 8), dims={"d0", "d1", "d2"}, id="view-unsqueeze")
case(T.view, (r(6, 4, 2, 3), 2, 3, 4, 6), dims={"d0", "d1", "d2"}, id="view-split-and-merge")
case(T.view, (r(6, 4), 4, 6), id="view-many-to-many")
for ns in (torch, T):
    case(ns.flatten, (r(4, 2, 3, 6), 1, 2), dims={"d0", "d1", "d2"})
    case(ns.unsqueeze, (x3, -1), dims={"d0", "d1", "d2"})
    case(ns.squeeze, (r(4, 1, 6),), dims={"d0", "d2"})
    case(ns.squeeze, (r(4, 1, 6), 1), dims={"d0", "d2"}, id=f"{ns.__name__}.squeeze-dim")
    case(ns.transpose, (x3, 0, 2), dims={"d0", "d1", "d2"})
    case(ns.t, (r(4, 6),), dims={"d0", "d1"})
    case(ns.split, (x3, 2), dict(dim=1), dims={"d0", "d2"})
    case(ns.split, (x3, [2, 6], -1), dims={"d0", "d1"}, id=f"{ns.__name__}.split-sections")
    case(ns.chunk, (x3, 3, 2), dims={"d0", "d1"})
    case(ns.unbind, (x3, 1), dims={"d0", "d2"})
    case(ns.sum, (x3,), dims={"d0", "d1", "d2"})
    case(ns.sum, (x3, 1), dims={"d0", "d1", "d2"}, id=f"{ns.__name__}.sum-dim")
    case(ns.sum, (x3,), dict(dim=(0, 2), keepdim=True), dims={"d0", "d1", "d2"},
         id=f"{ns.__name__}.sum-keepdim")
    case(ns.mean, (x3, -1), dims={"d0", "d1"})
    case(ns.mean, (x3,), id=f"{ns.__name__}.mean-all")
    case(ns.mm, (r(4, 6), r(6, 8)), dims="mkn")
    case(ns.bmm, (r(2, 4, 6), r(2, 6, 8)), dims="bmkn")
case(T.__getitem__, (x3, (Ellipsis, slice(None, 4))), dims={"d0", "d1"})
case(T.__getitem__, (x3, (slice(None), 1)), dims={"d0", "d2"}, id="getitem-int")
case(T.__getitem__, (x3, (None, slice(None), slice(2, 4))), dims={"d0", "d2"}, id="getitem-none")
case(T.__getitem__, (x3, (Ellipsis, None)), dims={"d0", "d1", "d2"}, id="getitem-ellipsis")
case(T.__getitem__, (x3, (slice(None), slice(None), slice(None, None, 2))), dims={"d0", "d1"},
     id="getitem-step")
case(T.__getitem__, (x3, slice(0, 4)), dims={"d0", "d1", "d2"}, id="getitem-full-slice")
case(T.expand, (r(4, 1, 6), 2, 4, 3, 6), dims={"d0", "d2"})
case(T.expand, (r(4, 1, 6), -1, 3, -1), dims={"d0", "d2"}, id="expand-minus-one")
case(T.expand_as, (r(1, 8), x3), dims={"e0", "e1", "d1"})
case(torch.outer, (r(4), r(6)), dims={"a", "b"})
for fn in (torch.triu, torch.tril, T.triu, T.tril):
    case(fn, (r(2, 6, 6), 1), dims={"_0"})
bn_stats = dict(running_mean=torch.zeros(4, dtype=torch.float64),
                running_var=torch.ones(4, dtype=torch.float64))
case(F.batch_norm, (img,), dict(bn_stats, weight=r(4), bias=r(4), training=True), dims={"c"})
# eval mode too: the generated code passes training=self.training, and a module traced in eval may train
case(F.batch_norm, (img,), dict(bn_stats, training=False), dims={"c"}, id="batch_norm-eval")
case(F.batch_norm, (r(4, 6), None, None), dict(training=True), dims={"c"}, id="batch_norm-no-stats")
case(T.permute, (x3, 2, 0, 1), dims={"d0", "d1", "d2"})
case(torch.permute, (x3, (1, 2, 0)), dims={"d0", "d1", "d2"})
case(T.contiguous, (x3.transpose(0, 1),), dims={"_0", "_1", "_2"})
case(torch.cat, ([x3, r(4, 2, 8)],), dict(dim=1), dims={"d0", "d2"})
case(torch.concat, ((x3, x3), -1), dims={"d0", "d1"})
case(torch.concatenate, ((x3, x3),), dict(axis=0), dims={"d1", "d2"})
case(torch.stack, ([x3, x3], 1), dims={"d0", "d1", "d2"})

logits, target = r(4, 6), torch.randint(0, 6, (4,))
for red, dims in [("none", {"n"}), ("sum", {"n"}), ("mean", set())]:
    case(F.cross_entropy, (logits, target), dict(reduction=red), dims=dims, id=f"ce-{red}")
    case(F.mse_loss, (x3, r(4, 6, 8)), dict(reduction=red), id=f"mse-{red}",
         dims=set() if red == "mean" else {"_0", "_1", "_2"} if red == "none" else {"d0", "d1"})
case(F.cross_entropy, (r(4, 6, 2, 2), torch.randint(0, 6, (4, 2, 2)), r(6)),
     dict(reduction="sum", label_smoothing=0.1), dims={"n", "s0", "s1"}, id="ce-spatial")
case(F.cross_entropy, (logits, torch.softmax(r(4, 6), -1)), dict(reduction="none"), dims={"n"},
     id="ce-probs")

q, k, v = r(2, 4, 6, 8), r(2, 4, 10, 8), r(2, 4, 10, 12)
case(F.scaled_dot_product_attention, (q, k, v), dims={"_0", "_1", "s", "e"})
case(F.scaled_dot_product_attention, (q, r(2, 4, 6, 8), r(2, 4, 6, 12)), dict(is_causal=True),
     dims={"_0", "_1", "e"}, id="sdpa-causal")
case(F.scaled_dot_product_attention, (q, k, v, torch.rand(6, 10) > 0.3), dims={"_0", "s", "e"},
     id="sdpa-mask")
case(F.scaled_dot_product_attention, (q, k, v), dict(attn_mask=r(2, 1, 6, 10), scale=0.3),
     dims={"_0", "_1", "s", "e"}, id="sdpa-float-mask")
# grouped-query attention (HF Llama / Qwen2 / Mistral): 4 query heads read 2 kv heads; splitting
# the kv heads h splits q's heads in matching groups
qg, kg, vg = r(2, 4, 6, 8), r(2, 2, 10, 8), r(2, 2, 10, 12)
case(F.scaled_dot_product_attention, (qg, kg, vg), dict(enable_gqa=True), dims={"_0", "h", "s", "e"},
     id="sdpa-gqa")
case(F.scaled_dot_product_attention, (qg, r(2, 2, 6, 8), r(2, 2, 6, 12)), dict(is_causal=True, enable_gqa=True),
     dims={"_0", "h", "e"}, id="sdpa-gqa-causal")
case(F.scaled_dot_product_attention, (qg, kg, vg), dict(attn_mask=r(2, 1, 6, 10), enable_gqa=True, scale=0.3),
     dims={"_0", "h", "s", "e"}, id="sdpa-gqa-mask")
case(F.scaled_dot_product_attention, (qg, kg, vg), dict(attn_mask=r(2, 4, 6, 10), enable_gqa=True),
     dims={"_0", "h", "s", "e"}, id="sdpa-gqa-head-mask")
case(F.scaled_dot_product_attention, (q, k, v), dict(enable_gqa=True), dims={"_0", "h", "s", "e"},
     id="sdpa-gqa-equal-heads")
# addmm (HF GPT-2's Conv1D: addmm(bias, x.view(-1, nx), W))
for fn in (torch.addmm, T.addmm):
    case(fn, (r(8), r(4, 6), r(6, 8)), dims={"m", "k", "n"})
case(torch.addmm, (r(4, 8), r(4, 6), r(6, 8)), dict(beta=0.5, alpha=2.0), dims={"m", "k", "n"},
     id="addmm-2d-scaled")
case(torch.addmm, (r(1, 8), r(4, 6), r(6, 8)), dims={"m", "k", "n"}, id="addmm-row-bias")
case(T.type, (r(4, 6), torch.float32), dims={"_0", "_1"})
# in-place elementwise (ResNet's residual `x += y`)
for name in builtin_ops._INPLACE_ELEMENTWISE:
    case(getattr(T, name), (r(4, 6), r(6)), dims={"_0", "_1"})
case(F.conv2d, (img, r(6, 4, 3, 3), r(6)), dict(padding=1), dims={"n", "c", "o"})
case(F.conv2d, (img, r(6, 2, 3, 3)), dict(groups=2), dims={"n"}, id="conv2d-groups")
case(F.conv2d, (r(4, 6, 6), r(6, 4, 3, 3)), dims={"c", "o"}, id="conv2d-unbatched")
case(F.conv1d, (r(2, 4, 6), r(6, 4, 3), r(6)), dims={"n", "c", "o"})
case(F.conv3d, (r(2, 2, 4, 4, 4), r(4, 2, 3, 3, 3)), dims={"n", "c", "o"})
for kdim, shape in [(1, (2, 4, 6)), (2, (2, 4, 6, 6)), (3, (2, 4, 4, 4, 4))]:
    t = r(*shape)
    case(getattr(F, f"max_pool{kdim}d"), (t, 2), dims={"_0", "_1"})
    case(getattr(F, f"max_pool{kdim}d"), (t, 2), dict(return_indices=True), dims={"_0", "_1"},
         id=f"max_pool{kdim}d-indices")
    case(getattr(F, f"max_pool{kdim}d_with_indices"), (t, 2), dims={"_0", "_1"})
    case(getattr(F, f"avg_pool{kdim}d"), (t, 2), dims={"_0", "_1"})
    case(getattr(F, f"adaptive_avg_pool{kdim}d"), (t, 1), dims={"_0", "_1"})
    case(getattr(F, f"adaptive_max_pool{kdim}d"), (t, 1), dims={"_0", "_1"})
    case(getattr(F, f"adaptive_max_pool{kdim}d"), (t, 1, True), dims={"_0", "_1"},
         id=f"adaptive_max_pool{kdim}d-indices")
    case(getattr(F, f"adaptive_max_pool{kdim}d_with_indices"), (t, 1), dims={"_0", "_1"})


@pytest.mark.parametrize("fn, args, kwargs, dims", [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_builtin_annotation_is_correct(fn, args, kwargs, dims):
    bound, checked = check_partitions(fn, args, kwargs)
    assert {str(d) for d in dims} <= set(checked), f"{bound}: only {checked} splittable"


def test_every_builtin_op_is_checked():
    covered = {id(c[1]) for c in CASES}
    missing = [REGISTRY.name_of(f) for f in REGISTRY.functions()
               if REGISTRY.name_of(f).startswith("torch.") and id(f) not in covered]
    assert not missing


def test_partial_splits_are_really_checked():
    bound, dims = check_partitions(F.linear, (x3, w, b))
    assert bound.partition("k", 2) == ([Shard(2), Shard(1), Partial()], [Partial()])
    assert "k" in dims


def test_checker_catches_a_wrong_annotation():
    reg = OpRegistry()
    reg.register(F.linear, "b... k, n k, n -> b... n k^")  # wrong: k is really reduced
    with pytest.raises(AnnotationError):  # and the output has no k: it does not bind
        parse_annotation(reg.lookup(F.linear, (x3, w, b))).bind(
            [x3.shape, w.shape, b.shape], [(4, 6, 10)])
    wrong = "b... k+, n k+, n -> b... n"  # the bias is not marked additive
    old = REGISTRY.annotation_of(F.linear)
    REGISTRY.register(F.linear, wrong, "torch.nn.functional.linear")
    try:
        with pytest.raises(AssertionError, match="split along 'k'"):
            check_partitions(F.linear, (x3, w, b))
    finally:
        REGISTRY.register(F.linear, old, "torch.nn.functional.linear")


# ------------------------------------------------------------------ specific annotations
@pytest.mark.parametrize("fn, args, kwargs, expected", [
    (F.linear, (x3, w), {}, "b... k+, n k+ -> b... n"),
    (F.linear, (x3,), dict(bias=b, weight=w), "b... k+, +n, n k+ -> b... n"),
    (T.__add__, (x3, 1), {}, "... -> ..."),
    (torch.add, (x3, x3), {}, "..., ... -> ..."),
    (torch.einsum, ("ij,jk->ik", r(2, 3), r(3, 4)), {}, "i j+, j+ k -> i k"),
    (T.view, (x3, 4, 6, 2, 4), {}, "d0 d1 (d2 d2_1^) -> d0 d1 d2 d2_1^"),
    (T.view, (r(8, 6, 4), 48, 4), {}, "d0 d0_1^ d1 -> (d0 d0_1^) d1"),
    (T.reshape, (r(6, 4), -1), {}, "d0 d0_1^ -> (d0 d0_1^)"),
    (T.reshape, (r(6, 4), 4, 6), {}, "d0_i0^ d0_i1^ -> d0_o0^ d0_o1^"),
    (T.transpose, (x3, 0, -1), {}, "d0 d1 d2 -> d2 d1 d0"),
    (T.sum, (x3,), dict(dim=1, keepdim=True), "d0 d1+ d2 -> d0 1 d2"),
    (torch.mean, (x3, 1), {}, "d0 d1^ d2 -> d0 d2"),
    (F.softmax, (x3,), dict(dim=-1), "d0 d1 d2^ -> d0 d1 d2^"),
    (F.embedding, (torch.zeros(2, 3, dtype=torch.long), w), {}, "..., v^ h -> ... h"),
    (F.scaled_dot_product_attention, (q, k, v), dict(is_causal=True),
     "... s^ d^, ... t^ d^, ... t^ e -> ... s^ e"),
    (F.cross_entropy, (logits, target), {}, "n^ c^, n^ -> 1"),
    (F.scaled_dot_product_attention, (qg, kg, vg), dict(enable_gqa=True),
     "... (h g^) s d^, ... h t^ d^, ... h t^ e -> ... (h g^) s e"),
    (torch.addmm, (r(8), r(4, 6), r(6, 8)), {}, "+n, m k+, k+ n -> m n"),
])
def test_annotation_text(fn, args, kwargs, expected):
    assert REGISTRY.lookup(fn, args, kwargs) == expected


@pytest.mark.parametrize("fn, args, kwargs", [
    (F.softmax, (x3,), {}),                         # implicit dim
    (torch.add, (x3, x3), dict(out=torch.empty(4, 6, 8, dtype=torch.float64))),
    (T.view, (x3, torch.float64), {}),                # a dtype view
    (torch.einsum, ("ii->i", r(3, 3)), {}),          # a diagonal
    (F.embedding, (torch.zeros(2, dtype=torch.long), w), dict(max_norm=1.0)),
    (F.scaled_dot_product_attention, (r(2, 3, 6, 8), r(2, 2, 10, 8), r(2, 2, 10, 12)), dict(enable_gqa=True)),
    (T.add_, (r(6), r(4, 6)), {}),                  # in place on the smaller tensor
    (T.type, (r(6),), {}),                           # returns the type's name
    (T.size, (x3,), {}),                              # not registered
    (T.__getitem__, (x3, torch.tensor([0, 1])), {}),  # advanced indexing
    (T.__getitem__, (x3, (0, 0, 0, 0)), {}),          # too many indices
])
def test_unannotated_calls(fn, args, kwargs):
    assert REGISTRY.lookup(fn, args, kwargs) is None


# ------------------------------------------------------------------ the registry itself
def test_registry_register_and_lookup():
    reg = OpRegistry()
    fn = lambda a: a  # noqa: E731
    reg.register(fn, "a -> a", name="mine.fn")
    assert fn in reg and len(reg) == 1 and reg.functions() == [fn]
    assert reg.lookup(fn, (torch.zeros(2),), {}) == "a -> a"
    assert reg.name_of(fn) == "mine.fn"
    assert reg.lookup(print, (), {}) is None
    assert [] not in reg and reg.lookup([], (), {}) is None  # unhashable


def test_registry_callable_annotations():
    reg = OpRegistry()

    def boom(*a, **k):
        raise IndexError

    reg.register(len, boom)
    reg.register(abs, lambda *a, **k: None)
    reg.register(max, lambda *a, **k: "a -> $")
    assert reg.lookup(len, (1,)) is None and reg.lookup(abs, (1,)) is None
    with pytest.raises(AnnotationError, match="builtins.max") as info:
        reg.lookup(max, (1,))
    assert info.value.position == 5


def test_registry_rejects_bad_annotations():
    reg = OpRegistry()
    with pytest.raises(AnnotationError):
        reg.register(len, "a b")
    with pytest.raises(TypeError):
        reg.register(len, 3)


def test_derived_names():
    assert REGISTRY.name_of(F.linear) == "torch.nn.functional.linear"
    assert REGISTRY.name_of(T.view) == "torch.Tensor.view"
    assert REGISTRY.name_of(T.__add__) == "torch.Tensor.__add__"
    assert REGISTRY.name_of(torch.matmul) == "torch.matmul"
    assert REGISTRY.name_of(F.max_pool2d) == "torch.nn.functional.max_pool2d"
    assert OpRegistry().name_of(torch.cat) == "torch.cat"
    assert OpRegistry().name_of(T.size) == "torch.Tensor.size"
    assert OpRegistry().name_of(F.pad) == "torch.nn.functional.pad"


def test_tensor_leaves_order():
    a, b2, c = torch.zeros(1), torch.zeros(2), torch.zeros(3)
    assert [t.numel() for t in tensor_leaves(((a, 1, [b2]), {"z": c, "y": None}))] == [1, 2, 3]
    assert [t.numel() for t in tensor_leaves(((), {"z": c, "a": a}))] == [3, 1]


# ------------------------------------------------------------------ register_op
class FakeTracer:
    def __init__(self):
        self.calls = []

    def record_custom_op(self, fn, args, kwargs):
        self.calls.append((fn, args, kwargs))
        return "recorded"


def my_matmul(a, b):
    return a @ b


def test_register_op_function_form():
    wrapped = register_op(my_matmul, "a b+, b+ c -> a c")
    assert wrapped.__nnscaler_op__ is my_matmul and my_matmul.__nnscaler_wrapper__ is wrapped
    assert wrapped.__name__ == "my_matmul" and wrapped.__wrapped__ is my_matmul
    a, bb = r(2, 3), r(3, 4)
    assert torch.equal(wrapped(a, bb), a @ bb)  # no tracer: runs the function
    for f in (wrapped, my_matmul):
        assert REGISTRY.lookup(f, (a, bb), {}) == "a b+, b+ c -> a c"
        assert REGISTRY.name_of(f) == f"{__name__}.my_matmul"
    tracer = FakeTracer()
    with tracing_context.activate(tracer):
        assert wrapped(a, b=bb) == "recorded"
    assert tracer.calls == [(my_matmul, (a,), {"b": bb})]
    assert tracing_context.current_tracer() is None
    assert check_partitions(wrapped, (r(4, 6), r(6, 8)))[1] == ["a", "b", "c"]


def test_register_op_decorator_forms():
    @register_op("a b -> b a", name="custom.flip")
    def flip(x):
        return x.t()

    @register_op(annotation=lambda x, scale=1.0: "... -> ...")
    def scale(x, scale=1.0):
        return x * scale

    assert flip.__nnscaler_op__.__name__ == "flip"
    assert REGISTRY.name_of(flip) == "custom.flip" == REGISTRY.name_of(flip.__nnscaler_op__)
    assert torch.equal(flip(torch.eye(2)), torch.eye(2))
    assert REGISTRY.lookup(scale, (x3,), {"scale": 2.0}) == "... -> ..."
    check_partitions(flip, (r(4, 6),))
    check_partitions(scale, (x3,), {"scale": 3.0})
    tracer = FakeTracer()
    with tracing_context.activate(tracer):
        scale(x3, scale=2.0)
    assert tracer.calls[0][0] is scale.__nnscaler_op__


def test_register_op_validates_immediately():
    with pytest.raises(AnnotationError) as info:
        register_op(my_matmul, "a b, b c -> a d")
    assert "register_op('my_matmul')" in str(info.value) and info.value.position == 14
    assert str(info.value).splitlines()[-1] == " " * 4 + " " * 14 + "^"
    with pytest.raises(AnnotationError):
        register_op("a $ -> a")
    with pytest.raises(TypeError):
        register_op(my_matmul)
    with pytest.raises(TypeError):
        register_op()
    with pytest.raises(TypeError):
        register_op(my_matmul, 3)
