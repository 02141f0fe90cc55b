"""Bad `parallelize()` arguments on one rank only: every rank raises, the others naming that rank.

One of 2 gloo processes passes ``dummy_forward_args`` that its own checks refuse (a list, not a
dict). Before, it raised alone and the good rank waited in parallelize's next collective until
the bad process exited, then raised gloo's "Connection closed by peer". Now the ranks agree once
their checks are done (runtime/driver/agreement.py): the bad rank raises its own error, the good
rank `PeerFailedError` naming the bad rank, its error and the line of its call; both stay in step,
so a second call with good arguments works.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

_RUNTIME_TESTS = str(Path(__file__).resolve().parents[1] / "runtime")
if _RUNTIME_TESTS not in sys.path:
    sys.path.insert(0, _RUNTIME_TESTS)

from launch import error_of, run_workers  # noqa: E402
from bad_inputs.models import Small  # noqa: E402


def _worker(rank, world, gen_dir, bad_rank):
    from nnscaler import ComputeConfig, parallelize

    good = {"x": torch.randn(2, 4)}
    args = list(good.values()) if rank == bad_rank else good
    cfg = ComputeConfig(1, world, trace_strategy="cpu")
    failed = error_of(lambda: parallelize(Small(), args, "dp", cfg, gen_savedir=gen_dir))  # THE CALL
    retried = error_of(lambda: parallelize(Small(), good, "dp", cfg, gen_savedir=gen_dir)(**good))
    return dict(failed=failed, retried=retried)


def _call_line() -> int:
    lines = Path(__file__).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if line.rstrip().endswith("# THE CALL"))


@pytest.mark.multiprocess
@pytest.mark.parametrize("bad_rank", [0, 1])
def test_bad_arguments_on_one_rank_are_raised_on_every_rank(bad_rank, tmp_path):
    results = run_workers(_worker, 2, str(tmp_path / "gen"), bad_rank, timeout=120)
    ours, kind, msg = results[bad_rank]["failed"]
    assert kind == "TypeError" and "dummy_forward_args must be a dict" in msg, msg  # its own error
    assert results[1 - bad_rank]["failed"] is not None, "the good rank's call went on (paired with a later one)"
    ours, kind, msg = results[1 - bad_rank]["failed"]
    print(f"rank {1 - bad_rank}:", msg)
    assert kind == "PeerFailedError", msg
    assert (f"rank {bad_rank} raised TypeError: dummy_forward_args must be a dict of forward arguments by name, "
            f"got list at {__file__}:{_call_line()}") in msg, msg
    assert f"fix the call on rank {bad_rank}" in msg and "Connection" not in msg, msg
    assert all(r["retried"] is None for r in results), results  # still in step: good arguments work
