"""Precision and loss scaling on a pipelined module, on 2 real gloo processes (pp 2, 1f1b, GPT).

The pipeline runs the stages itself, not the module's forward, so it must honour what
`apply_precision` installed on the module (input cast, autocast, fp32 outputs) and the
`scale_fn` of `train_step` (loss scaling). Checked against one process running the same
micro-batches under the same precision:

- bf16-mixed: losses and parameters after 3 Adam steps within 1e-5 of one process under
  torch.autocast, while fp32 training ends 2e-3 away (so autocast really ran in the stages);
  the returned losses are fp32.
- 16-mixed through PrecisionPlugin (GradScaler, `train_step(samples, scale_fn=plugin.scale_loss)`):
  the same against one process with torch.amp-style scaling; the scaler's scale is the same.
- `scale_fn=lambda l: l * 8` gives exactly 8x the gradients (the tied weight summed over two
  stages included), losses unscaled.
- A forward hook on a pipelined module is refused (it would silently not run), naming the hook.
"""
from __future__ import annotations

import pytest
import torch

from gpt import GPT, GPTConfig, random_batch
from launch import run_workers

STEPS = 3
NMICROS = 4
MICRO = 2
LR = 1e-3
TOL = 1e-5
GPT_CFG = dict(vocab_size=32, block_size=8, n_layer=4, n_head=2, n_embd=16)
LOW = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def _make():
    torch.manual_seed(0)
    return GPT(GPTConfig(**GPT_CFG))


def _micros(step):
    return [random_batch(step * NMICROS + i, MICRO, GPTConfig(**GPT_CFG)) for i in range(NMICROS)]


def reference(mode):
    """One process: the step's micro-batches in order (autocast in the mixed modes), gradients
    summed then scaled by 1 / NMICROS, Adam. Returns (per-step losses, parameters, final scale)."""
    from nnscaler.runtime.precision import GradScaler

    model = _make()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    scaler = GradScaler("cpu") if mode == "16-mixed" else None
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        step_losses = []
        for mb in _micros(step):
            with torch.autocast("cpu", dtype=LOW.get(mode, torch.float32), enabled=mode in LOW):
                loss = model(**mb)
            (scaler.scale(loss) if scaler else loss).backward()
            step_losses.append(loss.float().item())
        for p in model.parameters():
            p.grad.mul_(1 / NMICROS)
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        losses.append(step_losses)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    return losses, params, scaler.get_scale() if scaler else None


def _parallelize(gen_dir, name):
    from nnscaler import ComputeConfig, parallelize

    cfg = ComputeConfig(2, 2, trace_strategy="cpu", use_end2end=True,
                        pas_config={"pipeline_nmicros": NMICROS, "pipeline_scheduler": "1f1b"})
    return parallelize(_make(), _micros(0)[0], "pp", cfg, gen_savedir=gen_dir, instance_name=name)


def _train(gen_dir, mode):
    from nnscaler import build_optimizer
    from nnscaler.runtime.precision import PrecisionPlugin

    pm = _parallelize(gen_dir, "precision")
    plugin = PrecisionPlugin(None if mode == "fp32" else mode, device="cpu")
    pm = plugin.setup_module(pm)
    opt = plugin.setup_optimizer(build_optimizer(pm, torch.optim.Adam, lr=LR))
    losses, dtypes = [], set()
    for step in range(STEPS):
        opt.zero_grad()
        outs = pm.train_step(_micros(step), scale_fn=plugin.scale_loss if plugin.scaler else None)
        opt.scale_grads(1 / NMICROS)
        plugin.step(opt)
        losses.append([o.item() for o in outs])
        dtypes |= {o.dtype for o in outs}
    shards = {e.full_name: getattr(pm, local).detach().clone() for local, e in pm.fullmap.items()
              if isinstance(getattr(pm, local), torch.nn.Parameter) and e.slices == tuple((0, n) for n in e.full_shape)}
    return dict(losses=losses, dtypes=dtypes, params=shards, scale=plugin.scaler.get_scale() if plugin.scaler else None)


def _scale_fn_and_hooks(gen_dir):
    from nnscaler.runtime.errors import NnScalerError

    pm = _parallelize(gen_dir, "precision")
    outs = pm.train_step(_micros(0))
    grads = [p.grad.clone() for p in pm.parameters()]
    pm.zero_grad()
    outs8 = pm.train_step(_micros(0), scale_fn=lambda loss: loss * 8)
    exact = all(torch.equal(p.grad, 8 * g) for p, g in zip(pm.parameters(), grads))
    same_losses = [o.item() for o in outs] == [o.item() for o in outs8]

    def my_logging_hook(module, args, output):
        return output
    handle = pm.register_forward_hook(my_logging_hook)
    try:
        pm.train_step(_micros(0))
        refused = None
    except NnScalerError as exc:
        refused = str(exc)
    handle.remove()
    pm.train_step(_micros(0))  # runs again once the hook is gone
    return dict(exact=exact, same_losses=same_losses, refused=refused)


def run_cases(rank, world, gen_dir):
    results = {mode: _train(gen_dir, mode) for mode in ("fp32", "bf16-mixed", "16-mixed")}
    results["scale_fn"] = _scale_fn_and_hooks(gen_dir)
    return results


@pytest.mark.multiprocess
def test_pipeline_precision_and_loss_scaling(tmp_path):
    results = run_workers(run_cases, 2, str(tmp_path / "gen"), timeout=300)
    fp32_params = reference("fp32")[1]
    for mode in ("fp32", "bf16-mixed", "16-mixed"):
        ref_losses, ref_params, ref_scale = reference(mode)
        for rank, per_rank in enumerate(results):
            got = per_rank[mode]
            assert got["dtypes"] == {torch.float32}, f"{mode} rank {rank}: outputs {got['dtypes']}"
            for step, (g, w) in enumerate(zip(got["losses"], ref_losses)):
                assert max(abs(a - b) for a, b in zip(g, w)) <= TOL, f"{mode} rank {rank} step {step}: {g} vs {w}"
            for name, value in got["params"].items():
                diff = (value - ref_params[name]).abs().max().item()
                assert diff <= TOL, f"{mode} rank {rank}: {name} differs by {diff}"
            assert got["scale"] == ref_scale, f"{mode} rank {rank}: scale {got['scale']} vs {ref_scale}"
        held = set().union(*(r[mode]["params"] for r in results))
        assert held == set(ref_params), f"{mode}: parameters held by no rank: {set(ref_params) - held}"
        if mode != "fp32":  # autocast really ran in the stages: the parameters are far from fp32 training's
            gap = max((v - fp32_params[k]).abs().max().item() for r in results for k, v in r[mode]["params"].items())
            assert gap > 100 * TOL, f"{mode}: parameters within {gap} of fp32 training; autocast did not run"
    for rank, per_rank in enumerate(results):
        got = per_rank["scale_fn"]
        assert got["exact"] and got["same_losses"], f"rank {rank}: scale_fn did not scale the gradients exactly"
        assert got["refused"] and "my_logging_hook" in got["refused"] and "pipelined" in got["refused"], got["refused"]
