"""`cp`'s in-place writes through views (builtin/_cp_writes.py): DeepSeek-V3's key filled through views of
a ``new_empty`` is split along the sequence (each rank writes its own rows, nothing gathered) when every op
of the write can follow that split, and kept whole on every device (its inputs gathered) when one cannot."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nnscaler.ir import SDPA, ComputeConfig, Replicate, Shard, trace
from nnscaler.ir.graph import IRGraph
from nnscaler.policies import apply_policy
from nnscaler.policies.inplace_writes import write_groups


class KeyFill(torch.nn.Module):
    """Attention whose key is filled in place through views of a fresh tensor, as DeepSeek-V3's; `how`
    says how (the first two can follow the sequence split, the others cannot)."""

    def __init__(self, how):
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8)
        self.qkv = torch.nn.Linear(8, 24)
        self.out = torch.nn.Linear(8, 16)
        self.how = how

    def forward(self, ids, labels):
        b, s = ids.shape
        q, k, v = self.qkv(self.emb(ids)).view(b, s, 3, 2, 4).permute(2, 0, 3, 1, 4)  # (b, heads, s, 4)
        if self.how == "sizes":  # the sequence's size read off the ids, the others constants
            key = k.new_zeros(b, 2, s, 4)
        elif self.how == "constant":  # no size traced from a split value: which axis is the sequence is unknown
            key = k.new_empty(2, 2, 8, 4)
        else:
            key = k.new_empty(k.shape)
        if self.how == "rows":  # the views slice the sequence: a rank's piece is not its rows of them
            key[:, :, :s // 2].copy_(k[:, :, :s // 2])
            key[:, :, s // 2:].copy_(k[:, :, s // 2:] * 2)
        elif self.how == "reshape":  # a reshape of a piece may copy where the whole tensor's does not
            key.reshape(b, 2, s, 2, 2)[..., 0].copy_(k[..., ::2])
            key.reshape(b, 2, s, 2, 2)[..., 1].copy_(k[..., 1::2] * 2)
        else:
            key[..., :2].copy_(k[..., :2])
            if self.how == "read_between":  # read before the last write: a gathered copy would then go stale
                k = k * key[..., :1].sum()
            key[..., 2:].copy_(k[..., 2:] * 2)
        if self.how == "written_again":  # an in-place op on the base itself: kept whole it writes the base
            key.mul_(3)
        y = F.scaled_dot_product_attention(q, key, v, is_causal=True)
        return F.cross_entropy(self.out(y.transpose(1, 2).reshape(b, s, 8)).transpose(1, 2), labels)


def _planned(how, n=2):
    torch.manual_seed(0)
    ids = torch.randint(0, 16, (2, 8))
    graph = IRGraph.from_json(trace(KeyFill(how), {"ids": ids, "labels": ids}).to_json())
    return apply_policy(graph, ComputeConfig(n, n), "cp")


def _group(graph):
    groups = write_groups(graph)
    assert len(groups) == 1 and len(groups[0].writes) == 2 and groups[0].base is not None
    return groups[0]


@pytest.mark.parametrize("how", ["heads", "sizes"])
def test_a_key_filled_through_head_slices_splits_along_the_sequence(how, tmp_path):
    from nnscaler.codegen import generate
    graph = _planned(how)
    group = _group(graph)
    assert group.base.short_name in ("new_empty", "new_zeros") and len(group.views) == 2
    for node in group.ops():  # every op of the write: its own rows of the key (the key's axis 2) on each rank
        assert len(node.pieces) == 2 and all(p.dim is not None for p in node.pieces), node.describe()
        assert node.pieces[0].outputs[0] == Shard(2), node.describe()
        assert node.pieces[0].inputs[0] == Shard(2), node.describe()  # the base's: k, split along its sequence
    ring = next(n for n in graph.nodes if n.target == SDPA)
    assert ring.pieces[0].inputs[1] == Shard(2)  # attention reads the key as written
    cfg = ComputeConfig(2, 2)
    generate(graph, cfg, tmp_path)
    code = (tmp_path / "gencode1.py").read_text()
    lines = [line.strip() for line in code.splitlines() if not line.strip().startswith("#")]
    fill = next(i for i, line in enumerate(lines) if f".{group.base.short_name}(" in line)
    ring = next(i for i, line in enumerate(lines) if "nr.ring_attention.attention(" in line)
    assert "// 2)" in lines[fill], lines[fill]  # the rank's piece: half of the sequence
    assert not any("nr.comm." in line for line in lines[fill:ring]), lines[fill:ring]  # nothing gathered or sliced
    assert "nr.comm.all_gather(" not in code


@pytest.mark.parametrize("how", ["rows", "constant", "reshape", "read_between", "written_again"])
def test_a_write_that_cannot_follow_the_sequence_stays_whole(how, tmp_path):
    from nnscaler.codegen import generate
    graph = _planned(how)
    group = _group(graph)
    for node in group.ops():
        assert [p.dim for p in node.pieces] == [None, None], node.describe()
        assert all(isinstance(o, Replicate) for p in node.pieces for o in p.outputs), node.describe()
    generate(graph, ComputeConfig(2, 2), tmp_path)
    assert "nr.comm.all_gather(" in (tmp_path / "gencode0.py").read_text()  # its written values gathered


def test_four_ranks_split_it_too():
    group = _group(_planned("heads", n=4))
    assert all(len(node.pieces) == 4 and node.pieces[3].outputs[0] == Shard(2) for node in group.ops())
