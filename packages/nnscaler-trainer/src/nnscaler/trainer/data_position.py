"""Where a resumed run reads on: the data position within the epoch, carried over in samples.

Rank ``r`` of ``dp`` data-parallel ranks reads ``DistributedSampler(dataset, num_replicas=dp,
rank=r)``: the entries ``r, r + dp, r + 2 dp, ...`` of the epoch's order. With torch's
DistributedSampler that order does not depend on dp (``randperm(len(dataset))`` seeded with
``seed + epoch``, or ``range``; padding or truncation touches only the end). After ``k`` entries
read by every rank, the ranks together have read the first ``k * dp`` entries of the order.

So the position is one number, ``samples_in_epoch`` (steps taken in the epoch times the global
batch size): a run on ``dp'`` ranks that skips ``samples_in_epoch / dp'`` entries per rank reads
on from exactly where the saving run stopped, on any number of ranks, and every sample of the
epoch is read once across the two runs. A custom ``dataset_sampler.type`` gets the same skip; the
guarantee holds when its order has the same property.

When the global batch size changes too, the resumed run goes on at step ``samples_in_epoch /
global_batch_size`` of the epoch, which must be a whole step; otherwise the resume is refused (a
`TrainerConfigError` that says which sizes fit).
"""
from __future__ import annotations

from typing import Optional

from .errors import TrainerConfigError

__all__ = ["samples_in_epoch", "resumed_step_in_epoch", "skip_per_rank"]


def samples_in_epoch(idx_in_epoch: int, global_batch_size: int) -> int:
    """Samples the ranks together have read in the epoch after `idx_in_epoch` steps."""
    return idx_in_epoch * global_batch_size


def resumed_step_in_epoch(saved_samples: Optional[int], saved_idx: int, global_batch_size: int,
                          where: str = "the checkpoint") -> int:
    """The step within the epoch a resumed run continues from, given the saved position
    (`saved_samples`; None in a checkpoint that predates it: `saved_idx` steps of this run's
    global batch). Raises TrainerConfigError when this run's global batch size does not divide it."""
    if saved_samples is None:
        return saved_idx
    steps, rest = divmod(saved_samples, global_batch_size)
    if rest:
        saved_batch = saved_samples // saved_idx if saved_idx else None
        fits = [g for g in _divisors(saved_samples) if g <= 8 * global_batch_size][-4:]
        was = f" (global batch {saved_batch})" if saved_batch else ""
        raise TrainerConfigError("global_batch_size",
                                 f"is {global_batch_size}, but {where} stopped {saved_samples} samples into its "
                                 f"epoch{was}: a step of {global_batch_size} samples cannot start there, so the data "
                                 f"position would not carry over exactly. Resume with a global_batch_size that "
                                 f"divides {saved_samples} (e.g. {', '.join(map(str, fits))}) and change it from a "
                                 f"checkpoint at the end of an epoch (checkpoint.every_n_epochs)")
    return steps


def skip_per_rank(samples: int, dp: int) -> int:
    """Entries each of `dp` ranks skips to read on from `samples` (a multiple of dp: a whole
    step's samples are, since the global batch is a multiple of dp)."""
    if samples % dp:
        raise ValueError(f"{samples} samples do not split over {dp} data-parallel ranks")
    return samples // dp


def _divisors(n: int):
    return [d for d in range(1, n + 1) if n % d == 0]
