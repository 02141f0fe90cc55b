"""Both branches of a boolean decision on a tensor value in one graph (nnscaler.ir.tracer.branches)."""
from __future__ import annotations

import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

from nnscaler.ir import trace
from nnscaler.ir.tracer.branches import MAX_FLIPS, keep_traced_branch
from nnscaler.ir.graph import IRGraph
from nnscaler.ir.tracer.guards import guards_of

from guard_models import MaskBranch


def _trace(model, args, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return trace(model, args, **kw)


class MaskOrCausal(nn.Module):
    """HF's pattern: a mask when something is padded, else SDPA's is_causal."""

    def forward(self, q, attention_mask):
        if attention_mask.sum() == attention_mask.numel():
            mask = None
        else:
            mask = attention_mask.bool()[:, None, None, :] & torch.ones(4, 4, dtype=torch.bool).tril()
        return F.scaled_dot_product_attention(q, q, q, attn_mask=mask, is_causal=mask is None).sum()


def test_branch_only_ops_and_differing_arguments():
    g = _trace(MaskBranch(4), {"x": torch.randn(2, 4), "mask": torch.ones(2, 4)})
    (guard,) = guards_of(g)
    assert guard.kwargs["branches"] is True
    by_target = [(n.target.rsplit(".", 1)[-1], n.branch) for n in g.nodes]
    assert by_target == [("linear", None), ("__eq__", None), ("all", None), ("check", None),
                         ("mul", [guard.id, True]), ("mul", [guard.id, False]), ("sum", None)]
    traced_mul, other_mul, total = g.nodes[4], g.nodes[5], g.nodes[6]
    assert other_mul.args[1] == g.inputs[1].leaves[0][1]  # `h * mask`, on the forward's argument
    assert total.branch_args == [["args", 0, guard.id, traced_mul.outputs, other_mul.outputs]]
    back = IRGraph.from_json(g.to_json())
    assert [(n.branch, n.branch_args) for n in back.nodes] == [(n.branch, n.branch_args) for n in g.nodes]


def test_hf_pattern_traced_with_padding_keeps_the_mask_and_the_causal_branch():
    q = torch.randn(2, 1, 4, 8)
    padded = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    g = _trace(MaskOrCausal(), {"q": q, "attention_mask": padded})
    (guard,) = guards_of(g)
    assert guard.kwargs["branches"] and guard.kwargs["traced"] is False
    sdpa = [n for n in g.nodes if n.target.endswith("scaled_dot_product_attention")]
    assert len(sdpa) == 1  # one op, its arguments differ: the mask (only in one branch) or None
    (node,) = sdpa
    mask_ref = node.kwargs["attn_mask"]
    assert sorted(map(tuple, [e[1:] for e in node.branch_args]), key=str) == sorted(
        [("attn_mask", guard.id, None, mask_ref), ("is_causal", guard.id, True, False)], key=str)
    producers = {r.id: n for n in g.nodes for r in n.output_refs()}
    assert producers[mask_ref.id].branch == [guard.id, False]  # the mask is built only when padded


def test_traced_unpadded_the_other_branchs_mask_is_copied_in():
    q = torch.randn(2, 1, 4, 8)
    g = _trace(MaskOrCausal(), {"q": q, "attention_mask": torch.ones(2, 4, dtype=torch.long)})
    (guard,) = guards_of(g)
    assert guard.kwargs["branches"] and guard.kwargs["traced"] is True
    (node,) = [n for n in g.nodes if n.target.endswith("scaled_dot_product_attention")]
    # the op's base arguments are the side with the mask (its layout is planned); None on the other
    entry = next(e for e in node.branch_args if e[1] == "attn_mask")
    assert entry[3] is None and node.kwargs["attn_mask"] == entry[4]
    copied = [n for n in g.nodes if n.branch == [guard.id, False]]
    assert copied and all(n.id not in {m.id for m in g.nodes if m is not n} for n in copied)


def test_not_representable_or_untraceable_stays_a_guard():
    class OtherOutput(nn.Module):
        def forward(self, x):
            if x.sum() > 0:
                return x.sum()
            return (x * 2).sum(), x  # another output structure

    g = _trace(OtherOutput(), {"x": torch.ones(3)})
    (guard,) = guards_of(g)
    assert "branches" not in guard.kwargs and all(n.branch is None and not n.branch_args for n in g.nodes)
    g = _trace(MaskBranch(4), {"x": torch.randn(2, 4), "mask": torch.ones(2, 4)}, both_branches=False)
    assert "branches" not in guards_of(g)[0].kwargs and all(n.branch is None for n in g.nodes)


def test_at_most_max_flips_decisions_are_retraced():
    calls = []

    class Many(nn.Module):
        def forward(self, x):
            calls.append(1)
            for i in range(MAX_FLIPS):
                if x[i] > 0:
                    x = x + 1
                else:
                    x = x - 1
            if x[-1] > 0:  # one decision too many
                x = x * 2
            return x.sum()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        g = trace(Many(), {"x": torch.ones(MAX_FLIPS + 1)}, both_modes=False)
    decisions = [d for d in guards_of(g) if "decision" in d.kwargs]
    assert len(calls) == 1 + MAX_FLIPS  # one trace, one re-trace per flipped decision
    assert [d.kwargs.get("skipped") is not None for d in decisions] == [False] * MAX_FLIPS + [True]
    # the first merges; later ones overlap its branches (every later value depends on it): guarded
    assert [bool(d.kwargs.get("branches")) for d in decisions] == [True] + [False] * MAX_FLIPS
    messages = [str(w.message) for w in caught if "Python" in str(w.message)]
    assert len(messages) == 2 and "both branches are generated" in messages[0]
    assert f"not traced: more than {MAX_FLIPS} decisions in one forward" in messages[1]
    assert "raises nnscaler.runtime.GuardError" in messages[1]


def test_keep_traced_branch_undoes_the_merge():
    g = _trace(MaskBranch(4), {"x": torch.randn(2, 4), "mask": torch.ones(2, 4)})
    plain = _trace(MaskBranch(4), {"x": torch.randn(2, 4), "mask": torch.ones(2, 4)}, both_branches=False)
    keep_traced_branch(g)
    assert [n.target for n in g.nodes] == [n.target for n in plain.nodes]
    assert [(n.args, n.branch, n.branch_args) for n in g.nodes] == [(n.args, None, []) for n in plain.nodes]
    assert "branches" not in guards_of(g)[0].kwargs


class PackedPositions(nn.Module):
    """transformers 5's packed-sequence check (masking_utils.find_packed_sequence_indices) with the
    shape reads on one line, as every library op maps to the model's one calling line: the first
    read feeds only the packed branch, so the traced (unpacked) graph drops it as dead code."""

    def forward(self, x):
        b, pos = x.shape[0], torch.arange(x.shape[1])[None].expand(x.shape[0], -1)  # noqa: E501
        packed = (torch.diff(pos, prepend=pos[:, :1] - 1, dim=-1) != 1).cumsum(-1)
        y = x if (packed[:, -1] == 0).all() else x * packed[..., None] * b
        return y.sum()


def test_a_shape_read_dropped_as_dead_code_in_one_trace_still_lines_up():
    g = _trace(PackedPositions(), {"x": torch.randn(2, 4, 3)})
    (guard,) = guards_of(g)
    assert guard.kwargs.get("branches") is True, "the packed-sequence decision stays a guard"
    assert any(n.branch == [guard.id, False] for n in g.nodes)
