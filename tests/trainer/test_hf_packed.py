"""Packed documents given as ``cu_seqlens`` to `nnscaler.trainer.hf.CausalLM` (hf/packed.py).

transformers' sdpa attention ignores flash attention's ``cu_seq_lens_q`` / ``_k`` (its logits are
those of one long document: checked here); `CausalLM` turns the boundaries into ``position_ids``
restarting per document, so the loss (a float64 model) equals each document run alone: the mean over every
document's next-token losses, none predicting across a boundary (1e-6: transformers computes its loss
in float32). ``cu_seqlens``, transformers'
``cu_seq_lens_q`` and the equivalent ``position_ids`` give the same loss. Bad boundaries are refused
before the step (the hook), naming the key, the values and the fix. No process; the multi-process
parity under cp is tests/models/test_cp_packed.py's launch."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nnscaler.trainer import TrainerConfigError
from nnscaler.trainer.hf import CausalLM
from nnscaler.trainer.hf.packed import check_cu_seqlens, position_ids_from_cu_seqlens

transformers = pytest.importorskip("transformers")

VOCAB, DOCS = 64, [5, 9, 2]
CONFIG = {"model_type": "llama", "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 64, "attn_implementation": "sdpa"}


def _cu(docs):
    return torch.tensor([0] + torch.tensor(docs).cumsum(0).tolist(), dtype=torch.int32)


def test_positions_restart_at_every_boundary():
    got = position_ids_from_cu_seqlens(_cu([3, 1, 4, 2, 6]), (2, 8))
    assert got.tolist() == [[0, 1, 2, 0, 0, 1, 2, 3], [0, 1, 0, 1, 2, 3, 4, 5]]


def test_cu_seqlens_loss_equals_each_document_alone():
    torch.manual_seed(0)
    model = CausalLM(config=CONFIG).double().eval()
    ids = torch.randint(0, VOCAB, (1, sum(DOCS)), generator=torch.Generator().manual_seed(1))
    cu = _cu(DOCS)
    with torch.no_grad():
        got = model({"input_ids": ids, "cu_seqlens": cu})
        total, count, start = 0.0, 0, 0
        for d in DOCS:  # each document alone, its own next-token losses
            doc = ids[:, start:start + d]
            logits = model.model(input_ids=doc).logits
            total += F.cross_entropy(logits[0, :-1], doc[0, 1:], reduction="sum").item()
            count += d - 1
            start += d
        assert got.item() == pytest.approx(total / count, rel=1e-6)  # transformers computes the loss in float32
        hf_name = model({"input_ids": ids, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": 9,
                         "max_length_k": 9})
        positions = model({"input_ids": ids, "position_ids": position_ids_from_cu_seqlens(cu, (1, sum(DOCS)))})
        assert hf_name.item() == got.item() and positions.item() == pytest.approx(got.item(), rel=1e-12)
        # what transformers' sdpa does with the flash-attention kwargs alone: one long document
        raw = model.model(input_ids=ids, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=9, max_length_k=9).logits
        assert torch.equal(raw, model.model(input_ids=ids).logits)


@pytest.mark.parametrize("batch, key, says", [
    ({"cu_seqlens": [0, 4, 8]}, "cu_seqlens", r"is list: give one 1-D integer tensor"),
    ({"cu_seqlens": torch.tensor([[0, 4, 8]])}, "cu_seqlens", r"is \(1, 3\)"),
    ({"cu_seqlens": torch.tensor([0.0, 8.0])}, "cu_seqlens", r"1-D integer"),
    ({"cu_seqlens": torch.tensor([1, 8])}, "cu_seqlens", r"runs from 1 to 8: it must start at 0 and end at the "
                                                         r"batch's 8 tokens"),
    ({"cu_seqlens": torch.tensor([0, 6])}, "cu_seqlens", r"end at the batch's 8 tokens"),
    ({"cu_seqlens": torch.tensor([0, 5, 3, 8])}, "cu_seqlens", r"decreases at index 2 \(5 -> 3\)"),
    ({"cu_seq_lens_q": torch.tensor([0, 4, 8]), "cu_seq_lens_k": torch.tensor([0, 8])}, "cu_seq_lens_k",
     "differs from cu_seq_lens_q"),
    ({"cu_seqlens": torch.tensor([0, 8]), "cu_seq_lens_q": torch.tensor([0, 8])}, "cu_seqlens", "pass the boundaries "
                                                                                               "once"),
    ({"cu_seqlens": torch.tensor([0, 3, 8]), "position_ids": torch.arange(8)[None]}, "position_ids",
     r"do not restart at 0 exactly at the boundaries of cu_seqlens \(\[0, 3, 8\]\)"),
])
def test_bad_boundaries_are_refused_naming_the_key(batch, key, says):
    batch = {"input_ids": torch.zeros(1, 8, dtype=torch.long), **batch}
    with pytest.raises(TrainerConfigError, match=says) as e:
        check_cu_seqlens(batch, "b")
    assert f"b['{key}']" in str(e.value)


def test_a_document_crossing_rows_is_refused_and_agreeing_positions_pass():
    ids = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(TrainerConfigError, match=r"no boundary at token 4, where row 1 of input_ids \(2, 4\) starts"):
        check_cu_seqlens({"input_ids": ids, "cu_seqlens": torch.tensor([0, 3, 6, 8])})
    cu = torch.tensor([0, 3, 4, 8])
    check_cu_seqlens({"input_ids": ids, "cu_seqlens": cu, "position_ids": position_ids_from_cu_seqlens(cu, (2, 4))})


def test_the_hook_checks_every_micro_batch_before_the_step():
    torch.manual_seed(0)
    model = CausalLM(config=CONFIG)
    good = {"input_ids": torch.zeros(1, 8, dtype=torch.long), "cu_seqlens": torch.tensor([0, 8])}
    model.on_train_step_start(None, [good])
    with pytest.raises(TrainerConfigError, match=r"train micro-batch 1\['cu_seqlens'\]"):
        model.on_train_step_start(None, [good, {**good, "cu_seqlens": torch.tensor([0, 7])}])
    with pytest.raises(TrainerConfigError, match=r"validation micro-batch 0\['cu_seqlens'\]"):
        model.on_val_step_start(None, [{**good, "cu_seqlens": torch.tensor([0, 7])}])
