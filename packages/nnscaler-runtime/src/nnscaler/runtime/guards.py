"""Run-time checks of the Python decisions the trace took on tensor values (guards).

Generated code calls `check` where the user's forward read a tensor's value in Python
(``if (mask == 1).all():``, ``t.item()``, ``t.tolist()`` ...; see nnscaler.ir.tracer.guards). The value
is recomputed from what the program computes anyway (the generated code makes the tensor whole
first) and compared with the value seen while tracing. A mismatch raises `GuardError`, naming
the user's line, what the value derives from, the traced and the current value, and the fix.

Every rank raises: with ``agree=True`` (a world of more than one rank and a module that is not
pipelined) the ranks agree on the outcome with one all-reduce (MAX) of a one-element flag per
guard, so a data-parallel peer whose data took the traced branch does not wait forever in the
next collective. A pipelined module passes ``agree=False``: its executor already sends a failure
notice to every peer when a stage raises.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from nnscaler.ir import READ_TEXT, guard_values_close as close, guard_digest as digest

from .errors import NnScalerError
from . import failures

__all__ = ["GuardError", "check"]


class GuardError(NnScalerError, RuntimeError):
    """The data took another branch (or read another value) in the user's forward than the
    example the module was traced with; the generated code holds only the traced branch."""


def _read(value: torch.Tensor, read: str):
    if read == "bool":
        return bool(value)
    if read == "int":
        return int(value)
    if read == "float":
        return float(value)
    if read == "index":
        return value.__index__()
    return value.item()


def _matches(value: torch.Tensor, read: str, traced: Any):
    """(matches?, what is seen now, for the message)."""
    dtype = str(value.dtype).replace("torch.", "")
    if read in ("tolist", "array"):
        if isinstance(traced, dict):  # a large tensor: compared through its digest
            now = digest(value)
            return all(close(a, b, dtype) for a, b in zip(now, traced["digest"])), f"digest {now}"
        now = value.detach().cpu().tolist()
        same = _same_nested(now, traced, dtype)
        return same, (now if value.numel() <= 16 else "another tensor")
    now = _read(value, read)
    if read == "bool":
        return now == traced, now
    return close(now, traced, dtype), now


def _same_nested(a, b, dtype) -> bool:
    if isinstance(a, list) or isinstance(b, list):
        return isinstance(a, list) and isinstance(b, list) and len(a) == len(b) and all(
            _same_nested(x, y, dtype) for x, y in zip(a, b))
    return close(a, b, dtype)


def check(value: Optional[torch.Tensor], read: str, traced: Any, *, at: str = "", cause: str = "", via: str = "",
          agree: bool = False, decision: Optional[int] = None) -> None:
    """Raise GuardError (on every rank when `agree`) unless `read` of `value` gives `traced`. `value`
    None: a guard inside a branch of a decision this rank's data did not take (nothing to check; the
    rank still joins the agreement, as its peers that took the branch do)."""
    ok, now = _matches(value.detach(), read, traced) if value is not None else (True, None)
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() \
        else (0, 1)
    bad_rank = None if ok else rank
    if agree and world > 1:
        flag = torch.tensor([0 if ok else rank + 1], dtype=torch.int64, device=_flag_device(value))
        # through failures.run: a peer that failed before reaching this guard is noticed, not waited for
        failures.run(dist.all_reduce, flag, op=dist.ReduceOp.MAX, what=f"the guard at {at or 'a value read'}")
        bad = int(flag.item())
        bad_rank = bad - 1 if bad else None
    if bad_rank is None:
        return
    error = GuardError(_message(read, traced, now if not ok else None, bad_rank, rank, world, at, cause, via))
    # all ranks agreed and raise here together: their collectives stay in step (runtime/failures/)
    error.raised_on_every_rank = agree and world > 1
    raise error


def _flag_device(value: Optional[torch.Tensor]) -> torch.device:
    if value is not None:
        return value.device
    if dist.get_backend() == "nccl":  # NCCL all-reduces device tensors only
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _message(read, traced, now, bad_rank, rank, world, at, cause, via) -> str:
    where = f" at {at}" if at else ""
    called = f" (called from the model's line {via})" if via else ""
    shown = traced if not isinstance(traced, (list, dict)) else "the traced tensor"
    if now is not None:
        seen = f"is {now!r} now" + (f" (rank {rank})" if world > 1 else "")
    else:
        seen = f"differs now on rank {bad_rank} (this rank, {rank}, matched; every rank stops together)"
    origin = f" The value derives from {cause}." if cause else ""
    what = "the branch" if read == "bool" else "the value"
    return (f"the data takes another branch than the example the module was traced with: forward reads a "
            f"tensor's value in Python ({READ_TEXT[read]}){where}{called}. While tracing it was {shown!r}; it "
            f"{seen}.{origin} The generated code holds only {what} taken while tracing. Fix: trace with an "
            f"example that takes the branch your data takes (e.g. a padded batch when batches are padded), "
            f"or compute it with tensor ops (torch.where, masking) instead of a Python decision")
