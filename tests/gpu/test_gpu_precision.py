"""bf16 and fp16 on CUDA: a GPT parallelized with `dp` on one rank under PrecisionPlugin
("bf16-mixed"; "16-mixed" with the grad scaler) against the same model in eager PyTorch under
torch.autocast on CUDA (with torch's GradScaler for fp16). Same weights, same batches: the
first loss agrees within 1e-5 relative (the same low-precision kernels; an fp32 run is further
off: not equal, checked), the later ones within a few units of the format's roundoff."""
from __future__ import annotations

import pytest
import torch

from gpu_support import device, gpt_batch, gpu, make_gpt, no_tf32, on, trace_strategy

pytestmark = gpu
STEPS, N, LR = 4, 8, 1e-3
DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
LOSS_RTOL = {"bf16-mixed": 1e-2, "16-mixed": 5e-3}  # ~2.5u of bf16, ~10u of fp16 (tests/runtime)


def _eager(mode):
    dev = device()
    model = make_gpt().to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    scaler = torch.amp.GradScaler(dev.type) if mode == "16-mixed" else None
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        with torch.autocast(dev.type, dtype=DTYPES[mode]):
            loss = model(**on(gpt_batch(step, N), dev))
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        losses.append(loss.float().item())
    return losses


@pytest.mark.parametrize("mode", ["bf16-mixed", "16-mixed"])
def test_mixed_precision_matches_eager_autocast(mode, tmp_path):
    from nnscaler import ComputeConfig, build_optimizer, parallelize
    from nnscaler.runtime.precision import GradScaler, PrecisionPlugin
    with no_tf32():
        want = _eager(mode)
        fp32_loss0 = make_gpt().to(device())(**on(gpt_batch(0, N), device())).item()
        pm = parallelize(make_gpt(), gpt_batch(0, N), "dp", ComputeConfig(1, 1, trace_strategy=trace_strategy()),
                         gen_savedir=tmp_path, instance_name=mode.replace("-", "_"))
        plugin = PrecisionPlugin(mode, device=device().type)
        assert isinstance(plugin.scaler, GradScaler) == (mode == "16-mixed")
        pm = plugin.setup_module(pm)
        opt = plugin.setup_optimizer(build_optimizer(pm, torch.optim.Adam, lr=LR))
        losses = []
        for step in range(STEPS):
            opt.zero_grad()
            loss = pm(**gpt_batch(step, N))
            plugin.backward(loss)
            plugin.step(opt)
            losses.append(loss.float().item())
    assert {p.dtype for p in pm.parameters()} == {torch.float32}  # fp32 weights in mixed mode
    assert abs(losses[0] - want[0]) <= 1e-5 * abs(want[0]), (mode, losses, want)
    assert fp32_loss0 != want[0], "autocast changed nothing: the comparison proves nothing"
    for step, (got, ref) in enumerate(zip(losses, want)):
        assert abs(got - ref) <= LOSS_RTOL[mode] * abs(ref), (mode, step, got, ref)
    if plugin.scaler is not None:
        assert plugin.scaler.get_scale() > 0 and torch.isfinite(torch.tensor(losses)).all()
