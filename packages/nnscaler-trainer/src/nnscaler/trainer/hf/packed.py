"""Packed documents given as ``cu_seqlens`` (flash-attention's cumulative lengths) for `CausalLM`.

transformers takes them as ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (``DataCollatorWithFlattening(
return_flash_attn_kwargs=True)``) and reads them only in its flash-attention paths; its ``sdpa`` and
``eager`` attention ignore them and attend across the documents (checked on transformers 5: the
logits are those of one long document). Flash attention does not run on the CPU, and `cp` needs
``sdpa``. So `CausalLM` turns the boundaries into what every attention implementation reads:
``position_ids`` restarting at 0 at each document, from which transformers builds its packed-document
mask (and `cp` reads that mask as key intervals, docs/long-context.md).

`position_ids_from_cu_seqlens` is tensor ops only (no value read in Python: nothing to guard when
traced); `check_cu_seqlens` reads the values, before the step, and names what is wrong.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional, Tuple

import torch

from ..errors import TrainerConfigError

__all__ = ["CU_SEQLENS_KEYS", "check_cu_seqlens", "cu_seqlens_of", "position_ids_from_cu_seqlens"]

CU_SEQLENS_KEYS = ("cu_seqlens", "cu_seq_lens_q", "cu_seq_lens_k")  # ours; transformers' flash-attention kwargs


def cu_seqlens_of(batch: Mapping[str, Any]) -> Optional[torch.Tensor]:
    """The batch's document boundaries: ``cu_seqlens``, else transformers' ``cu_seq_lens_q``; None without."""
    for key in CU_SEQLENS_KEYS[:2]:
        if batch.get(key) is not None:
            return batch[key]
    return batch.get("cu_seq_lens_k")


def position_ids_from_cu_seqlens(cu_seqlens: torch.Tensor, shape: Tuple[int, int]) -> torch.Tensor:
    """(B, L) positions restarting at 0 at every boundary of `cu_seqlens` (1-D, over the batch's B x L
    tokens in row-major order, as flash attention's varlen kernels take them: 0, then each document's
    end). Tensor ops only."""
    b, length = shape
    cu = cu_seqlens.to(torch.long)
    flat = torch.arange(b * length, device=cu.device)
    doc = torch.searchsorted(cu, flat, right=True) - 1  # the document holding each token
    return (flat - cu[doc.clamp_min(0)]).reshape(b, length)


def check_cu_seqlens(batch: Mapping[str, Any], where: str = "the batch") -> None:
    """Refuse boundaries that do not describe the batch's documents (TrainerConfigError naming the key,
    the values and the fix): not 1-D integers; not starting at 0 and ending at B x L; decreasing;
    a document crossing a row of a (B, L) batch; ``cu_seq_lens_q`` != ``cu_seq_lens_k`` (cross-attention);
    ``position_ids`` given too that do not restart exactly there (``DataCollatorWithFlattening`` gives
    both, which agree; `CausalLM` then uses the positions)."""
    given = [k for k in CU_SEQLENS_KEYS if batch.get(k) is not None]
    if not given:
        return
    if "cu_seqlens" in given and len(given) > 1:
        raise TrainerConfigError(f"{where}['cu_seqlens']", f"given with {given[1:]}: pass the boundaries once "
                                                           f"(cu_seqlens, or transformers' cu_seq_lens_q / _k)")
    q, k = batch.get("cu_seq_lens_q"), batch.get("cu_seq_lens_k")
    if q is not None and k is not None and not torch.equal(torch.as_tensor(q), torch.as_tensor(k)):
        raise TrainerConfigError(f"{where}['cu_seq_lens_k']", "differs from cu_seq_lens_q: queries and keys in "
                                                             "other documents are cross-attention, which a causal LM "
                                                             "does not run; give one set of boundaries")
    key = given[0]
    cu = batch[key]
    ids = batch["input_ids"]
    total = ids.numel()
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.is_floating_point() or cu.is_complex() \
            or cu.numel() < 2:
        shape = tuple(cu.shape) if isinstance(cu, torch.Tensor) else type(cu).__name__
        raise TrainerConfigError(f"{where}['{key}']", f"is {shape}: give one 1-D integer tensor [0, end of document "
                                                      f"1, ..., {total}] over the batch's tokens in row-major order "
                                                      f"(a batch of several samples: collate their boundaries "
                                                      f"into one, offset by each row's start)")
    values = cu.tolist()
    if values[0] != 0 or values[-1] != total:
        raise TrainerConfigError(f"{where}['{key}']", f"runs from {values[0]} to {values[-1]}: it must start at 0 and "
                                                      f"end at the batch's {total} tokens (input_ids "
                                                      f"{tuple(ids.shape)})")
    bad = next((i for i in range(1, len(values)) if values[i] < values[i - 1]), None)
    if bad is not None:
        raise TrainerConfigError(f"{where}['{key}']", f"decreases at index {bad} ({values[bad - 1]} -> "
                                                      f"{values[bad]}): cumulative lengths never decrease")
    length = ids.shape[-1]
    crossing = sorted(set(range(0, total, length)) - set(values))
    if crossing:
        raise TrainerConfigError(f"{where}['{key}']", f"has no boundary at token {crossing[0]}, where row "
                                                      f"{crossing[0] // length} of input_ids {tuple(ids.shape)} "
                                                      f"starts: a document would cross two rows; add the row "
                                                      f"starts to the boundaries")
    positions = batch.get("position_ids")
    if positions is not None and not torch.equal(torch.as_tensor(positions).reshape(-1).long(),
                                                 position_ids_from_cu_seqlens(cu, (1, total)).reshape(-1)):
        raise TrainerConfigError(f"{where}['position_ids']", f"do not restart at 0 exactly at the boundaries of "
                                                             f"{key} ({values}): the two would define different "
                                                             f"documents; drop one of them (CausalLM derives the "
                                                             f"positions from {key})")
