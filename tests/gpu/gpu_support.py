"""What the gpu tests share: the skip marker, the device, float tolerances with TF32 off, and
the small GPT they train.

Every test of the tier carries ``pytest.mark.gpu`` and skips without CUDA. The tests whose
logic does not depend on CUDA itself (parity of plans, precision, the Lightning strategy, the
Trainer) also run on the CPU with ``NNSCALER_GPU_TESTS_ON_CPU=1``: a way to check the tier's own
code on a machine without a GPU (the runtime then places everything on the CPU). The tests that
measure something only CUDA has (``max_memory_allocated``, pinned memory, the CUDA generator)
stay skipped there.
"""
from __future__ import annotations

import contextlib
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
ON_CPU = os.environ.get("NNSCALER_GPU_TESTS_ON_CPU") == "1" and not HAS_CUDA
REASON = "needs a CUDA device (NNSCALER_GPU_TESTS_ON_CPU=1 runs the device-agnostic ones on the CPU)"
needs_cuda = pytest.mark.skipif(not (HAS_CUDA or ON_CPU), reason=REASON)
cuda_only = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
gpu = [pytest.mark.gpu, needs_cuda]  # pytestmark of a module whose tests also run with ON_CPU

TOL = 1e-5  # fp32 on one device, TF32 off: the same kernels, sums in another order at most
GPT_CFG = dict(vocab_size=32, block_size=8, n_layer=4, n_head=2, n_embd=16)


def device() -> torch.device:
    """Where the tests compare: cuda:0, or the CPU under NNSCALER_GPU_TESTS_ON_CPU=1."""
    return torch.device("cuda", 0) if HAS_CUDA else torch.device("cpu")


def trace_strategy() -> str:
    """The seed's default on CUDA; "cpu" when checking the tier on the CPU."""
    return "cuda_run_cpu_offload" if HAS_CUDA else "cpu"


@contextlib.contextmanager
def no_tf32():
    """fp32 matmuls and convolutions in full fp32 (TF32 would make parity a 1e-3 matter)."""
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def make_gpt(**overrides):
    from gpt import GPT, GPTConfig
    torch.manual_seed(0)
    return GPT(GPTConfig(**{**GPT_CFG, **overrides}))


def gpt_batch(step: int, n: int, **overrides) -> dict:
    from gpt import GPTConfig, random_batch
    return random_batch(step, n, GPTConfig(**{**GPT_CFG, **overrides}))


def on(batch: dict, dev: torch.device) -> dict:
    return {k: v.to(dev) for k, v in batch.items()}


LR = 0.1  # SGD: linear in the gradients, so CUDA's atomics (embedding backward) stay at 1e-7


def eager(steps: int, n: int, dev=None):
    """The plain PyTorch loop (SGD, LR) on `dev`: per-step losses and the final parameters (on
    the CPU). Adam would turn a 1e-7 difference of a near-zero gradient into a full LR step."""
    dev = dev or device()
    model = make_gpt().to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        loss = model(**on(gpt_batch(step, n), dev))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().cpu().clone() for k, v in model.named_parameters()}


def full_params(pm) -> dict:
    """A one-rank module's parameters by their single-device names, on the CPU."""
    return {pm.fullmap[n].full_name: p.detach().cpu().clone() for n, p in pm.named_parameters()}


def assert_close(got: list, want: list, what: str, tol: float = TOL) -> None:
    assert len(got) == len(want), what
    for step, (g, w) in enumerate(zip(got, want)):
        assert abs(g - w) <= tol * max(1.0, abs(w)), f"{what} step {step}: {g} vs {w}"


def assert_params_close(got: dict, want: dict, what: str, tol: float = TOL) -> None:
    assert set(got) == set(want), f"{what}: {sorted(set(got) ^ set(want))}"
    for name, value in got.items():
        diff = (value.float() - want[name].float()).abs().max().item()
        assert diff <= tol, f"{what}: {name} differs by {diff}"
