"""Long context with transformers' own loss and packed documents: a tiny Llama (sdpa) trained by
``model(input_ids, labels=..., position_ids=...).loss`` (its ForCausalLMLoss: labels shifted, -100
ignored, mean in float32) under ``cp`` 4, and ``cp`` 2 x dp 2, one sequence per unit holding several
documents (``position_ids`` restarting at 0 per document: transformers attends within each), 3 Adam
steps, equals one process within the float32 bars (the loss runs in float32: losses 1e-5 relative,
every parameter 1e-5 per tensor ||a - b|| / ||b||). The one-process reference itself attends per
document: its packed logits equal each document run alone (float64, 1e-10). Each rank's loss covers
its own tokens (``nr.sequence_loss.cross_entropy``; nothing of the logits' size gathered: the
all-gathers of a step carry less than one logits tensor), and the packed mask reaches ring attention
as key intervals. The same documents given as ``cu_seqlens`` (flash attention's boundaries, turned into
positions by hf.CausalLM's `position_ids_from_cu_seqlens`) under cp 4: the same parity. One launch of
4 ranks."""
from __future__ import annotations

import glob
import os

import pytest
import torch

from launch import run_workers

VOCAB, SEQ, STEPS, LR = 64, 32, 3, 1e-3
DOCS = [[[10, 12, 10], [5, 20, 7]], [[32], [8, 8, 16]], [[4, 24, 4], [14, 18]]]  # per step, per sample


class OwnLoss(torch.nn.Module):
    """A causal LM trained with its own loss (``labels=``)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, labels, position_ids):
        return self.model(input_ids=input_ids, labels=labels, position_ids=position_ids).loss


class CuSeqlensLoss(OwnLoss):
    """The same, the documents given as ``cu_seqlens`` (hf.CausalLM's conversion to positions)."""

    def forward(self, input_ids, labels, cu_seqlens):
        from nnscaler.trainer.hf.packed import position_ids_from_cu_seqlens
        positions = position_ids_from_cu_seqlens(cu_seqlens, tuple(input_ids.shape))
        return self.model(input_ids=input_ids, labels=labels, position_ids=positions).loss


def _llama(wrap=OwnLoss):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                      attention_dropout=0.0, attn_implementation="sdpa", use_cache=False)
    torch.manual_seed(0)
    return wrap(LlamaForCausalLM(cfg)).double()


def _sample(step, i, cu=False):
    docs = DOCS[step][i]
    g = torch.Generator().manual_seed(100 * step + i)
    labels = torch.randint(0, VOCAB, (1, SEQ), generator=g)
    labels[0, :3] = -100  # ignored positions
    out = {"input_ids": torch.randint(0, VOCAB, (1, SEQ), generator=g), "labels": labels}
    if cu:  # the same documents as flash attention's cumulative lengths
        out["cu_seqlens"] = torch.tensor([0] + torch.tensor(docs).cumsum(0).tolist(), dtype=torch.int32)
    else:
        out["position_ids"] = torch.cat([torch.arange(d) for d in docs])[None]
    return out


def _reference(samples):
    """One process: Adam over `samples` per step (each sample's loss / len(samples), accumulated)."""
    model = _llama()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        total = 0.0
        for i in samples:
            loss = model(**_sample(step, i)) / len(samples)
            loss.backward()
            total += loss.item()
        opt.step()
        losses.append(total)
    return losses, {k: v.detach() for k, v in model.named_parameters()}


def _train(rank, world, plan, gen, cu=False):
    import torch.distributed as dist
    from nnscaler import ComputeConfig, build_optimizer, parallelize
    from nnscaler.runtime.comm import count_collectives
    unit = rank // plan
    pm = parallelize(_llama(CuSeqlensLoss if cu else OwnLoss), _sample(0, 0, cu), "cp", ComputeConfig(plan, world),
                     gen_savedir=gen, instance_name=f"packed_cp{plan}{'_cu' if cu else ''}")
    opt = build_optimizer(pm, torch.optim.Adam, lr=LR)
    losses, gathered = [], []
    for step in range(STEPS):
        opt.zero_grad()
        with count_collectives() as stats:
            loss = pm(**_sample(step, unit, cu))
            loss.backward()
        gathered.append(stats.snapshot().get("all_gather", {}).get("bytes", 0))
        opt.step()
        t = loss.detach().reshape(1).double()
        dist.all_reduce(t)
        losses.append(t.item() / world)
    with pm.unsharded():
        params = {e.full_name: getattr(pm, local).detach().clone() for local, e in pm.fullmap.items()
                  if isinstance(getattr(pm, local), torch.nn.Parameter)}
    return losses, params, gathered


def _job(rank, world, gen_root):
    out = {"cp4": _train(rank, world, 4, os.path.join(gen_root, "cp4"))}
    out["cp2-dp2"] = _train(rank, world, 2, os.path.join(gen_root, "cp2-dp2"))
    out["cp4-cu_seqlens"] = _train(rank, world, 4, os.path.join(gen_root, "cp4-cu_seqlens"), cu=True)
    return out


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def test_packed_reference_attends_per_document():
    """transformers with restarting position_ids (one process) = each document alone."""
    model = _llama().model
    b = _sample(0, 0)
    packed = model(input_ids=b["input_ids"], position_ids=b["position_ids"]).logits
    start = 0
    for d in DOCS[0][0]:
        alone = model(input_ids=b["input_ids"][:, start:start + d]).logits
        assert (packed[:, start:start + d] - alone).abs().max().item() <= 1e-10
        start += d


@pytest.mark.multiprocess
@pytest.mark.slow
def test_own_loss_and_packed_documents_cp4_and_cp2_dp2(tmp_path):
    results = run_workers(_job, 4, str(tmp_path), timeout=400)
    logits_bytes = SEQ * VOCAB * 4 // 4  # one cp 4 rank's share of the float32 logits
    for label, samples in (("cp4", [0]), ("cp2-dp2", [0, 1]), ("cp4-cu_seqlens", [0])):
        ref_losses, ref_params = _reference(samples)
        losses, params, gathered = results[0][label]
        for got, want in zip(losses, ref_losses):
            assert abs(got - want) <= 1e-5 * abs(want), (label, losses, ref_losses)
        assert set(params) == set(ref_params)
        for name, value in params.items():
            assert _rel(value, ref_params[name]) <= 1e-5, (label, name, _rel(value, ref_params[name]))
        for rank in range(4):  # positions gathered (one int64 row, 128-256 bytes), never logits
            assert max(results[rank][label][2]) < logits_bytes, (label, rank, results[rank][label][2])
        code = [open(p).read() for p in glob.glob(str(tmp_path / label / "**" / "gencode*.py"), recursive=True)]
        assert code and all("nr.sequence_loss.cross_entropy(" in c and "attn_mask=" in c for c in code), label
