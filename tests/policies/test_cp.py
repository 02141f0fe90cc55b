"""The `cp` policy (builtin/cp.py) on a traced attention model: ops follow the sequence split from
the inputs, attention gets ring pieces, pipelines stage as asked, and each refusal names the value
and the fix."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nnscaler.ir import CROSS_ENTROPY, RING_DIM, SDPA, SEQUENCE_LOSS_DIM, ComputeConfig, Replicate, Shard, trace
from nnscaler.ir.config import ConfigError
from nnscaler.ir.graph import IRGraph
from nnscaler.policies import PlanError, apply_policy
from nnscaler.policies.plan import tensor_outputs

from cp_models import AttentionMoE


class Attention(torch.nn.Module):
    def __init__(self, eager=False, dropout=0.0, causal=True, reduction="mean", packed=False):
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8)
        self.qkv = torch.nn.Linear(8, 24)
        self.out = torch.nn.Linear(8, 16)
        self.eager, self.dropout, self.causal, self.reduction, self.packed = eager, dropout, causal, reduction, packed

    def forward(self, ids, labels):
        b, s = ids.shape
        q, k, v = self.qkv(self.emb(ids)).view(b, s, 3, 2, 4).permute(2, 0, 3, 1, 4)
        if self.packed:  # documents from positions restarting at 0, a causal mask per document (as transformers)
            pos = labels % 4
            doc = (torch.diff(pos, prepend=pos[:, :1] - 1) != 1).cumsum(-1)
            at = torch.arange(s)
            mask = (doc[:, None, :, None] == doc[:, None, None, :]) & (at[None, None, None, :] <= at[None, None, :, None])
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        elif self.eager:
            y = torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout, is_causal=self.causal)
        logits = self.out(y.transpose(1, 2).reshape(b, s, 8))
        return F.cross_entropy(logits.transpose(1, 2), labels, reduction=self.reduction)


def _graph(model, seq=8):
    torch.manual_seed(0)
    ids = torch.randint(0, 16, (2, seq))
    return IRGraph.from_json(trace(model, {"ids": ids, "labels": ids}).to_json())


def test_ops_follow_the_sequence_and_attention_rings():
    graph = apply_policy(_graph(Attention()), ComputeConfig(2, 4), "cp")
    ring = next(n for n in graph.nodes if n.target == SDPA)
    assert [p.dim for p in ring.pieces] == [RING_DIM, RING_DIM]
    assert all(isinstance(p, Shard) and p.dim == 2 for p in ring.pieces[0].inputs + ring.pieces[0].outputs)
    emb = next(n for n in graph.nodes if n.short_name == "embedding")
    assert emb.pieces[0].dim is not None and isinstance(emb.pieces[0].outputs[0], Shard) \
        and emb.pieces[0].outputs[0].dim == 1  # the embedding splits along the sequence


def test_mean_loss_splits_its_tokens_and_is_whole_on_every_rank():
    """A mean cross-entropy over sequence-split logits: its own tokens on each rank (logits and labels
    split alike, no gather), the mean replicated (nr.sequence_loss.cross_entropy); a sum splits by its
    annotation (partial sums)."""
    graph = apply_policy(_graph(Attention()), ComputeConfig(2, 2), "cp")
    loss = next(n for n in graph.nodes if n.target == CROSS_ENTROPY)
    assert [p.dim for p in loss.pieces] == [SEQUENCE_LOSS_DIM] * 2
    assert [(type(p).__name__, getattr(p, "dim", None)) for p in loss.pieces[0].inputs] == [("Shard", 2), ("Shard", 1)]
    assert all(isinstance(p, Replicate) for p in loss.pieces[0].outputs)
    graph = apply_policy(_graph(Attention(reduction="sum")), ComputeConfig(2, 2), "cp")
    loss = next(n for n in graph.nodes if n.target == CROSS_ENTROPY)
    assert loss.pieces[0].dim != SEQUENCE_LOSS_DIM and isinstance(loss.pieces[0].inputs[0], Shard)


def test_a_mask_built_from_positions_is_built_on_each_rank_rows_only():
    """The ops building an attention mask from whole positions are split along the mask's rows (each
    rank builds (L / N, L), never (L, L)); the ops that cannot split (the document index) stay whole."""
    seq = 8
    graph = apply_policy(_graph(Attention(packed=True), seq=seq), ComputeConfig(2, 2), "cp")
    square = [n for n in graph.nodes if n.target != SDPA and any(
        tuple(graph.value(r).shape)[-2:] == (seq, seq) and len(graph.value(r).shape) == 4 for r in tensor_outputs(graph, n))]
    assert len(square) >= 3  # ==, <=, &
    for node in square:
        assert len(node.pieces) == 2 and all(isinstance(o, Shard) and o.dim == 2 for o in node.pieces[0].outputs), \
            node.describe()


def test_pipeline_stages():
    cfg = ComputeConfig(4, 4, use_end2end=True, pas_config={"pp_size": 2, "pipeline_nmicros": 2})
    graph = apply_policy(_graph(Attention()), cfg, "cp")
    ring = next(n for n in graph.nodes if n.target == SDPA)
    assert graph.pipeline is not None and len(ring.pieces) == 2


def test_sequence_not_in_2n_chunks():
    with pytest.raises(PlanError, match=r"sequence of 6 positions, which does not split into 4 equal chunks .*"
                                        r"multiple of 4"):
        apply_policy(_graph(Attention(), seq=6), ComputeConfig(2, 2), "cp")
    apply_policy(_graph(Attention(causal=False), seq=6), ComputeConfig(2, 2), "cp")  # not causal: 2 chunks do


def test_eager_attention_is_refused_naming_its_softmax():
    with pytest.raises(PlanError, match=r"found no torch.nn.functional.scaled_dot_product_attention .*softmax at "
                                        r".*test_cp.py.*attn_implementation='sdpa'"):
        apply_policy(_graph(Attention(eager=True)), ComputeConfig(2, 2), "cp")


def test_attention_dropout_is_refused():
    with pytest.raises(PlanError, match=r"dropout_p=0.1, which ring attention does not"):
        apply_policy(_graph(Attention(dropout=0.1)), ComputeConfig(2, 2), "cp")


def test_bad_sequence_dim():
    with pytest.raises(ConfigError, match=r"sequence_dim'\] must be"):
        apply_policy(_graph(Attention()), ComputeConfig(2, 2, pas_config={"sequence_dim": "seq"}), "cp")


def test_autodist_may_ring_the_attention():
    from nnscaler.policies.autodist.choices import node_choices
    graph = _graph(Attention(), seq=8)
    attention = next(n for n in graph.nodes if n.target == SDPA)
    assert "ring" in [c.label for c in node_choices(graph, attention, 2)]
    assert "ring" not in [c.label for c in node_choices(graph, attention, 8)]  # 8 positions are not 16 chunks
    comm = {"backend": "given", "collectives": {c: {"2": [1e-5, 5e9]} for c in
                                                ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")}}
    constraints = {"_comm_profile": comm, "_profile_repeats": 1}
    from nnscaler.policies.autodist.cost_model import build_problem
    from nnscaler.policies.autodist.comm_model import CommModel
    from nnscaler.policies.autodist.config import AutodistConfig
    cfg = AutodistConfig.from_compute_config(ComputeConfig(2, 2, pas_config=constraints))
    problem = build_problem(graph, 2, {attention.id: (1e-3, 2e-3)}, CommModel(comm), cfg)
    op = next(o for o in problem.ops if o.node.id == attention.id)
    times = dict(zip(op.labels, op.time))
    assert times["ring"] > 3e-3 / 2  # half the compute plus the blocks passed around the ring


def test_experts_split_over_the_unit_as_ep():
    from nnscaler.ir import EXPERT_DIM, ROUTED_EXPERTS
    graph = apply_policy(_graph(AttentionMoE()), ComputeConfig(2, 4), "cp")
    experts = next(n for n in graph.nodes if n.target == ROUTED_EXPERTS)
    assert [p.dim for p in experts.pieces] == [EXPERT_DIM, EXPERT_DIM]
    assert all(isinstance(p, Shard) and p.dim == 0 for p in experts.pieces[0].inputs)  # tokens and experts
    router = next(n for n in graph.nodes if n.module_path == "router")
    assert router.pieces[0].dim is not None  # the flattened tokens split by the batch, not gathered
    one = apply_policy(_graph(AttentionMoE()), ComputeConfig(2, 4, pas_config={"ep_size": 1}), "cp")
    experts = next(n for n in one.nodes if n.target == ROUTED_EXPERTS)
    assert experts.pieces[0].dim != EXPERT_DIM and isinstance(experts.pieces[0].inputs[3], type(Replicate()))


def test_ep_size_between_stores_the_experts_over_the_unit(tmp_path):
    """ep_size 2 of 4 devices: the experts stored 1/4 per device (Shard(0), as full ep), the piece's dim
    "e:2"; codegen makes the groups' and the replica sets' process groups and passes ep_size."""
    from nnscaler.codegen import generate
    from nnscaler.ir import ROUTED_EXPERTS, expert_group
    cfg = ComputeConfig(4, 4, pas_config={"ep_size": 2})
    graph = apply_policy(_graph(AttentionMoE()), cfg, "cp")
    experts = next(n for n in graph.nodes if n.target == ROUTED_EXPERTS)
    assert [expert_group(p.dim) for p in experts.pieces] == [(True, 2)] * 4
    assert all(isinstance(p, Shard) and p.dim == 0 for p in experts.pieces[0].inputs)  # tokens and experts
    generate(graph, cfg, tmp_path / "gen")
    code = (tmp_path / "gen" / "gencode2.py").read_text()
    assert "nr.moe.expert_parallel(" in code and "ep_size=2" in code
    # the unit's group, the two groups of 2, then the replica sets (group positions 0 and 1)
    assert "(0, 1, 2, 3), (0, 1), (2, 3), (0, 2), (1, 3))" in code
    assert "'up', full_shape=(4, 16, 8), slices=((2, 3), (0, 16), (0, 8))" in code  # device 2: expert 2 of 4


@pytest.mark.parametrize("ep_size, words", [(3, r"must be a whole number dividing the 4 devices"),
                                            ("2", "must be a whole number")])
def test_bad_ep_size(ep_size, words):
    with pytest.raises(ConfigError, match=words):
        apply_policy(_graph(AttentionMoE()), ComputeConfig(4, 4, pas_config={"ep_size": ep_size}), "cp")


def test_experts_that_do_not_split_over_ep_size():
    with pytest.raises(PlanError, match=r"has 3 experts, which do not split over the 4 devices that store them under "
                                        r"pas_config\['ep_size'\] \(2\): .*ep_size=1: every expert on every device"):
        apply_policy(_graph(AttentionMoE(experts=3)), ComputeConfig(4, 4, pas_config={"ep_size": 2}), "cp")


def test_autodist_plans_ring_attention_with_expert_parallelism(tmp_path, monkeypatch):
    """autodist prices ring attention and split experts in one plan: with attention limited to the ring
    (a partition constraint), the search also splits the experts (its own choice among R, t and e: the
    cheapest), and codegen emits both runtime calls."""
    from nnscaler.codegen import generate
    from nnscaler.ir import EXPERT_DIM, ROUTED_EXPERTS
    from nnscaler.policies.autodist.choices import node_choices
    monkeypatch.setenv("NNSCALER_CACHE_DIR", str(tmp_path / "cache"))
    rules = tmp_path / "rules.yaml"
    rules.write_text("- op: scaled_dot_product_attention\n  allowed: [ring]\n")
    comm = {"backend": "given", "collectives": {c: {"2": [1e-5, 5e9]} for c in
                                                ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")}}
    torch.manual_seed(0)
    model = AttentionMoE()
    model.up, model.down = (torch.nn.Parameter(torch.randn(4, 256, 8) * 0.1),  # experts: most of the weights
                            torch.nn.Parameter(torch.randn(4, 8, 128) * 0.1))
    graph = _graph(model)
    experts = next(n for n in graph.nodes if n.target == ROUTED_EXPERTS)
    assert [c.label for c in node_choices(graph, experts, 2)] == ["R", "t", "e"]
    cfg = ComputeConfig(2, 2, pas_config={"_comm_profile": comm, "_profile_repeats": 1,
                                          "partition_constraints_path": str(rules)})
    planned = apply_policy(graph, cfg, "autodist")
    ring = next(n for n in planned.nodes if n.target == SDPA)
    experts = next(n for n in planned.nodes if n.target == ROUTED_EXPERTS)
    assert ring.pieces[0].dim == RING_DIM and experts.pieces[0].dim == EXPERT_DIM
    generate(planned, cfg, tmp_path / "gen")
    code = (tmp_path / "gen" / "gencode0.py").read_text()
    assert "nr.ring_attention.attention(" in code and "nr.moe.expert_parallel(" in code
