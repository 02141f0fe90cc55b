import pytest

from nnscaler.ir.ops.annotation import AnnotationError, parse_annotation
from nnscaler.ir.layout import Partial, Replicate, Shard

R, V = Replicate(), Partial()


# ------------------------------------------------------------------ parsing
@pytest.mark.parametrize("text", [
    "b... k+, n k+, n -> b... n",
    "b... k+, n k+, +n -> b... n",
    "... k+, n k+ -> ... n",
    "... m k+, ... k+ n -> ... m n",
    "..., ... -> ...",
    "... d^ -> ... d^",
    "b s, v^ h -> b s h",
    "a b+ -> a",
    "a b+ -> a 1",
    "a, ? -> a",
    "  a_1   B2 ,?->a_1  ",
    "a -> a b^",
    "b s (h d) -> b s h d",
    "(a b^ c) -> a b c",
])
def test_valid_annotations_parse(text):
    anno = parse_annotation(text)
    assert anno.text == text
    assert parse_annotation(text) is anno  # cached


def test_parsed_structure():
    anno = parse_annotation("b... k+, n k+, +n -> b... n")
    assert [str(t) for t in anno.inputs] == ["b... k+", "n k+", "+n"]
    assert [str(t) for t in anno.outputs] == ["b... n"]
    assert anno.reduced == {"k"} and anno.frozen == frozenset()
    assert [t.additive for t in anno.inputs] == [False, False, True]
    assert parse_annotation("a, ? -> a").inputs[1].dims is None


def caret_column(err: AnnotationError) -> int:
    lines = str(err).splitlines()
    assert lines[1] == "    " + err.annotation  # the annotation is quoted on the 2nd line
    return lines[2].index("^") - 4


@pytest.mark.parametrize("text, pos, expected", [
    ("a b, b c", 8, "expected '->'"),
    ("a $ b -> a", 2, "unexpected character '$'"),
    ("..., ... ... -> ...", 9, "at most one '...'"),
    ("a b -> a c", 9, "output dim 'c' appears in no input"),
    ("a k+ -> a k", 10, "marked '+'"),
    ("a k+ -> a k+", 10, "marked '+'"),
    ("a, , b -> a", 3, "empty tensor entry"),
    ("a b ->", 6, "empty tensor entry"),
    (" -> a", 1, "empty tensor entry"),
    ("a+b -> a", 2, "expected a space"),
    ("1+ -> 1", 1, "markers go on named dims only"),
    ("...^ -> ...", 3, "markers go on named dims only"),
    ("a 12 -> a", 2, "size-1 dim '1'"),
    ("a -> b -> a", 7, "single '->'"),
    ("a a -> a", 2, "appears twice"),
    ("x... a, y... a -> a", 8, "share one name"),
    ("a -> ?", 5, "inputs only"),
    ("a, b ? -> a", 5, "whole tensor entry"),
    ("a -> ...", 5, "no input does"),
    ("a -> +a", 5, "inputs only"),
    ("a, +? -> a", 4, "right after"),
    ("a . b -> a", 2, "unexpected character '.'"),
    ("(a b -> a", 5, "expected a member name or ')'"),
    ("() -> a", 1, "empty group"),
    ("(a b)c -> a", 5, "expected a space"),
    ("(a b)^ -> a", 5, "markers go on named dims only"),
    ("(a+ b) -> a", 2, "in a group"),
    ("(a ...) -> a", 3, "expected a member name"),
    ("(a a) -> a", 3, "appears twice"),
    ("a (b a) -> a", 5, "appears twice"),
])
def test_malformed_annotation_has_caret(text, pos, expected):
    with pytest.raises(AnnotationError) as info:
        parse_annotation(text)
    err = info.value
    assert isinstance(err, ValueError)
    assert err.annotation == text and err.position == pos
    assert expected in str(err)
    assert caret_column(err) == pos


def test_non_string():
    with pytest.raises(AnnotationError):
        parse_annotation(3)


# ------------------------------------------------------------------ binding
def test_bind_expands_named_ellipsis():
    b = parse_annotation("b... k+, n k+, +n -> b... n").bind(
        [(2, 3, 4), (5, 4), (5,)], [(2, 3, 5)])
    assert b.inputs == (("b0", "b1", "k"), ("n", "k"), ("n",))
    assert b.outputs == (("b0", "b1", "n"),)
    assert dict(b.sizes) == {"b0": 2, "b1": 3, "k": 4, "n": 5}
    assert str(b) == "b0 b1 k+, n k+, +n -> b0 b1 n"


def test_bind_ellipsis_right_aligned_with_broadcast():
    b = parse_annotation("... m k+, ... k+ n -> ... m n").bind(
        [(2, 1, 3, 4), (5, 4, 6)], [(2, 5, 3, 6)])
    assert b.inputs == (("_0", "1", "m", "k"), ("_1", "k", "n"))  # size 1 broadcast -> '1'
    assert b.outputs == (("_0", "_1", "m", "n"),)
    assert b.sizes["_1"] == 5
    assert b.partition("_1", 5) == ([R, Shard(0)], [Shard(1)])
    assert b.partition("_0", 2) == ([Shard(0), R], [Shard(0)])


def test_bind_empty_ellipsis_and_scalar():
    b = parse_annotation("k+, k+ -> 1").bind([(4,), (4,)], [()])
    assert b.outputs == ((),)
    assert b.partition("k", 2) == ([Shard(0), Shard(0)], [V])
    b = parse_annotation("..., ... -> ...").bind([(), (3,)], [(3,)])
    assert b.inputs == ((), ("_0",))


def test_ellipsis_names_avoid_explicit_names():
    b = parse_annotation("... _0 -> ... _0").bind([(2, 3)], [(2, 3)])
    assert b.inputs == (("__0", "_0"),)


def test_question_mark_accepts_anything():
    b = parse_annotation("a, ? -> a").bind([(4,), None], [(4,)])
    assert b.inputs == (("a",), None)
    assert b.partition("a", 2) == ([Shard(0), R], [Shard(0)])
    parse_annotation("a, ? -> a").bind([(4,), (7, 7)], [(4,)])


@pytest.mark.parametrize("text, ins, outs, expected", [
    ("a b, b c -> a c", [(2, 3), (4, 5)], [(2, 5)],
     "dim 'b' .* size 3 in input 0 .* size 4 in input 1"),
    ("a b -> a b", [(2,)], [(2,)], "annotated 'a b' \\(2 dims\\) but has shape \\(2,\\)"),
    ("... a b -> ... a b", [(2,)], [(2,)], "at least 2 dims"),
    ("a 1 -> a 1", [(2, 3)], [(2, 3)], "annotated '1' but has size 3"),
    ("a -> a", [(2,), (2,)], [(2,)], "1 input"),
    ("a -> a", [None], [(2,)], "not a tensor"),
    ("..., ... -> ...", [(4, 3), (2, 3)], [(4, 3)], "size 4 .* size 2"),
    ("... -> ...", [(1, 3)], [(4, 3)], "appears in no input"),
    ("... -> ...", [(4, 3)], [(1, 3)], "size 4 .* size 1"),
])
def test_bind_errors(text, ins, outs, expected):
    with pytest.raises(AnnotationError, match=expected):
        parse_annotation(text).bind(ins, outs)


# ------------------------------------------------------------------ partitioning
def linear():
    return parse_annotation("b... k+, n k+, +n -> b... n").bind(
        [(2, 3, 4), (6, 4), (6,)], [(2, 3, 6)])


def test_partition_linear():
    b = linear()
    assert b.partition("n", 2) == ([R, Shard(0), Shard(0)], [Shard(2)])
    assert b.partition("k", 2) == ([Shard(2), Shard(1), V], [V])
    assert b.partition("b0", 2) == ([Shard(0), R, R], [Shard(0)])
    assert b.splittable_dims() == ["b0", "b1", "k", "n"]
    assert b.splittable_dims(2) == ["b0", "k", "n"]
    assert b.splittable_dims(3) == ["b1", "n"]


def test_partition_without_additive_bias_replicates_it():
    b = parse_annotation("a k+, a -> a").bind([(2, 4), (2,)], [(2,)])
    assert b.partition("k", 2) == ([Shard(1), R], [V])


@pytest.mark.parametrize("dim, n, expected", [
    ("x", 2, "unknown dim 'x'"),
    ("d", 2, "marked '\\^'"),
    ("1", 2, "size-1"),
    ("a", 3, "size 4 is not divisible by n=3"),
    ("a", 0, "n=0"),
])
def test_partition_errors(dim, n, expected):
    b = parse_annotation("a d^ 1 -> a d^ 1").bind([(4, 5, 1)], [(4, 5, 1)])
    with pytest.raises(AnnotationError, match=expected):
        b.partition(dim, n)


def test_dim_in_no_output_without_plus_is_not_splittable():
    b = parse_annotation("a b -> a").bind([(4, 6)], [(4,)])
    assert b.splittable_dims() == ["a"]
    with pytest.raises(AnnotationError, match="in no output"):
        b.partition("b", 2)


def test_new_frozen_output_dim():
    b = parse_annotation("a b^ -> a c^ d^").bind([(4, 6)], [(4, 2, 3)])
    assert b.splittable_dims() == ["a"]
    assert b.partition("a", 4) == ([Shard(0)], [Shard(0)])


def test_markers_are_global():
    b = parse_annotation("... d^ -> ... d").bind([(2, 3)], [(2, 3)])
    assert b.splittable_dims() == ["_0"]


# ------------------------------------------------------------------ groups
def test_group_split_heads():
    b = parse_annotation("b s (h d) -> b s h d").bind([(2, 3, 12)], [(2, 3, 4, 3)])
    assert b.inputs == (("b", "s", "(h d)"),) and b.sizes["h"] == 4 and b.sizes["d"] == 3
    assert str(b) == "b s (h d^) -> b s h d^"  # non-leading members are never split
    assert b.splittable_dims() == ["b", "s", "h"]
    assert b.partition("h", 2) == ([Shard(2)], [Shard(2)])
    assert b.partition("h", 4) == ([Shard(2)], [Shard(2)])
    with pytest.raises(AnnotationError, match="size 4 is not divisible by n=3"):
        b.partition("h", 3)  # 12 is divisible by 3, but the heads are not
    with pytest.raises(AnnotationError, match="'\\^'"):
        b.partition("d", 3)


def test_group_sizes_inferred_from_one_unknown_member():
    b = parse_annotation("(a b) c -> a c").bind([(6, 5)], [(2, 5)])
    assert b.sizes == {"c": 5, "a": 2, "b": 3}
    assert b.partition("a", 2) == ([Shard(0)], [Shard(0)])


@pytest.mark.parametrize("text, ins, outs, expected", [
    ("(a b) -> (a b)", [(6,)], [(6,)], "cannot tell the sizes of a, b"),
    ("(a b) -> a b", [(6,)], [(2, 4)], "size 6 but its members' sizes multiply to 8"),
    ("(a b) -> a", [(7,)], [(2,)], "size 7, which is not a multiple of 2"),
])
def test_group_bind_errors(text, ins, outs, expected):
    with pytest.raises(AnnotationError, match=expected):
        parse_annotation(text).bind(ins, outs)
