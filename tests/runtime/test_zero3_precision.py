"""Mixed precision under ``use_zero=3`` (``pas_config["zero3_mixed_precision"]``, FSDP2's
``MixedPrecisionPolicy``): fp32 shards gathered and computed in ``param_dtype``, gradients
reduce-scattered in ``reduce_dtype``, the optimizer stepping the fp32 shards.

One launch of 2 gloo ranks trains a tiny float32 Hugging Face Llama for 3 Adam steps under:

- no policy, and ``param_dtype="float32"``: the same run, bit for bit (losses, parameters, bytes);
- ``param_dtype="bfloat16", reduce_dtype="float32"``: against one process doing the same arithmetic
  (fp32 masters; each step each rank's half batch runs forward and backward on a bf16 copy of the
  parameters, buffers fp32; the bf16 gradients cast to fp32, each halved, summed; Adam in fp32).
  Tolerance: the losses are bf16 values (the model's logits are bf16) and the reference computes
  the same ops on the same inputs, so they must be equal to 1e-6 relative (bf16's step is 8e-3);
  the fp32 parameters within 1e-5 per tensor (fp32's bar: only the order of the two-term fp32 sums
  could differ). Against true fp32 training the losses differ (bf16 rounding), by < 2%.
  The shards and their gradients stay fp32, the gathers are bf16: half the all-gather bytes and
  half the most bytes gathered at once (comm and Zero3Stats counters), the same reduce-scatter bytes;
- ``param_dtype="float16", reduce_dtype="float32"``: the same against the reference in fp16;
- ``param_dtype="bfloat16"`` alone: reduced in bf16 too (FSDP2's default), half the reduce-scatter
  bytes, against the same reference reducing in bf16;
- per unit, the output head in fp32 (its input cast to fp32, FSDP2's cast_forward_inputs), against
  the reference doing that;
- bf16 / fp32 with gradient accumulation (2 micro-batches a step, the first under ``no_sync``: the
  units' bf16 gradients summed in the fp32 buffer, reduced once), against the reference doing that;
- tp 2, and pp 2 (2 micro-batches a step), with bf16 / fp32: the losses of one process doing the
  arithmetic, to bf16's step; per-unit entries under pp are refused on every rank;
- bf16 / fp32 with the units kept gathered from forward to backward (``zero3_reshard_after_forward``
  False): the bf16 run exactly, with no gather in backward.

A read of a parameter outside forward gives its fp32 value (the master), not the bf16 copy.
"""
from __future__ import annotations

import contextlib
import copy
import os
import sys

import pytest
import torch

from launch import run_workers

_MODELS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models")
if _MODELS not in sys.path:  # tests/models' Hugging Face builders (here and in the workers)
    sys.path.insert(0, _MODELS)

STEPS = 3
GLOBAL_BATCH = 4
LR = 1e-2
BF16_FP32 = {"param_dtype": "bfloat16", "reduce_dtype": "float32"}
HEAD_FP32 = {**BF16_FP32, "units": {"model.lm_head": {"param_dtype": "float32"}}}  # the output head in fp32
CASES = {"plain": None, "fp32": {"param_dtype": "float32"}, "bf16": BF16_FP32, "bf16-bf16": {"param_dtype": "bf16"},
         "head-fp32": HEAD_FP32, "bf16-kept": BF16_FP32, "bf16-accum": BF16_FP32,
         "fp16": {"param_dtype": "float16", "reduce_dtype": "float32"}}
KEPT = {"zero3_reshard_after_forward": False}  # "bf16-kept": the units stay gathered (in bf16) into backward


def _batch(step: int):
    import hf_models
    return hf_models.batch("llama", step, GLOBAL_BATCH)


def _micro(step: int, m: int, rank: int, per: int):
    """Rank `rank`'s micro-batch `m` of `step` (m > 0: gradient accumulation's further micro-batches)."""
    return {k: v[rank * per:(rank + 1) * per] for k, v in _batch(step + 100 * m).items()}


def reference(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, head_fp32=False, micro: int = 1,
              world: int = 2):
    """One process doing the policy's arithmetic over `world` replicas: (losses, fp32 parameters).
    `head_fp32`: the output head computes in fp32, its input cast to fp32 (FSDP2's cast_forward_inputs).
    `micro`: micro-batches per rank and step, their gradients summed in `reduce_dtype` (no_sync's buffer)."""
    import hf_models
    master = hf_models.make("llama", dtype=torch.float32)
    low = copy.deepcopy(master)
    if head_fp32:
        low.model.lm_head.register_forward_pre_hook(lambda m, args: tuple(a.float() for a in args))
    opt = torch.optim.Adam(master.parameters(), lr=LR)
    losses, per = [], GLOBAL_BATCH // world
    for step in range(STEPS):
        with torch.no_grad():
            for (n, p), m in zip(low.named_parameters(), master.parameters()):
                keep = head_fp32 and n == "model.lm_head.weight"
                p.data = m.detach().to(torch.float32 if keep else param_dtype)  # buffers stay fp32, as the runtime's
        sums = [torch.zeros_like(m, dtype=reduce_dtype) for m in master.parameters()]
        step_losses = []
        for r in range(world):
            acc = [torch.zeros_like(m, dtype=reduce_dtype) for m in master.parameters()]
            for m in range(micro):
                low.zero_grad()
                loss = low(**_micro(step, m, r, per)) / micro
                loss.backward()
                step_losses.append(loss.float().item())
                for a, p in zip(acc, low.parameters()):
                    a.add_(p.grad)
            for s, a in zip(sums, acc):
                s.add_(a / world)
        for m, s in zip(master.parameters(), sums):
            m.grad = s.to(m.dtype)
        opt.step()
        losses.append(sum(step_losses) / world)  # the per-rank sums of the micro-batches' losses, averaged
    return losses, {n: p.detach().clone() for n, p in master.named_parameters()}


def _case(rank, world, gen_dir, name, policy):
    import hf_models
    from nnscaler import ComputeConfig, build_optimizer, parallelize
    from nnscaler.runtime.comm import stats as comm_stats
    model = hf_models.make("llama", dtype=torch.float32)
    pas = {"zero3_mixed_precision": policy} if policy is not None else {}
    cfg = ComputeConfig(1, world, trace_strategy="cpu", use_zero=3, pas_config={**pas, **(KEPT if "kept" in name else {})})
    per = GLOBAL_BATCH // world
    pm = parallelize(model, {k: v[:per] for k, v in _batch(0).items()}, "dp", cfg, gen_savedir=gen_dir,
                     instance_name=f"precision_{name.replace('-', '_')}")
    opt = build_optimizer(pm, torch.optim.Adam, lr=LR)
    comm_stats.enable_stats()
    comm_stats.reset_stats()
    losses = []
    micro = 2 if "accum" in name else 1
    for step in range(STEPS):
        opt.zero_grad()
        total = 0.0
        for m in range(micro):  # gradient accumulation: all but the last micro-batch inside no_sync
            with pm.no_sync() if m < micro - 1 else contextlib.nullcontext():
                loss = pm(**_micro(step, m, rank, per)) / micro
                loss.backward()
            total += loss.detach().float()
        opt.step()
        t = total.reshape(1).clone()
        torch.distributed.all_reduce(t)
        losses.append(t.item() / world)
    comm = comm_stats.stats_snapshot()
    comm_stats.disable_stats()
    fs = pm.fully_sharded
    head = next(local for local in pm.fullmap if pm.fullmap[local].full_name == "model.lm_head.weight")
    out = {"losses": losses, "loss_dtype": str(loss.dtype),
           "shard_dtypes": sorted({str(u.shard.dtype) for u in fs.units}),
           "grad_dtypes": sorted({str(u.shard.grad.dtype) for u in fs.units if u.shard.grad is not None}),
           "optimizer_dtypes": sorted({str(p.dtype) for g in opt.param_groups for p in g["params"]}),
           "gather_bytes": comm["zero3_all_gather"]["bytes"], "reduce_bytes": comm["zero3_reduce_scatter"]["bytes"],
           "max_gathered_bytes": fs.stats.max_gathered_bytes, "max_gathered_numel": fs.stats.max_gathered_numel,
           "read_dtype": str(getattr(pm, head).dtype),  # a read outside forward: the master's dtype
           "policies": {u.name: (str(u.precision.param_dtype), str(u.precision.reduce_dtype)) for u in fs.units},
           "backward_gathers": fs.stats.backward_gathers}
    with pm.unsharded():
        out["params"] = {pm.fullmap[local].full_name: p.detach().clone() for local, p in pm.named_parameters()}
    return out


def _tp_case(rank, world, gen_dir):
    """tp 2 (a unit of both ranks: zero groups of one) with bf16 / fp32: the losses and dtypes."""
    import hf_models
    from nnscaler import ComputeConfig, build_optimizer, parallelize
    cfg = ComputeConfig(2, world, trace_strategy="cpu", use_zero=3, pas_config={"zero3_mixed_precision": BF16_FP32})
    pm = parallelize(hf_models.make("llama", dtype=torch.float32), _batch(0), "tp", cfg, gen_savedir=gen_dir,
                     instance_name="precision_tp2")
    opt = build_optimizer(pm, torch.optim.Adam, lr=LR)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = pm(**_batch(step))
        loss.backward()
        opt.step()
        losses.append(loss.float().item())
    return {"losses": losses, "loss_dtype": str(loss.dtype),
            "shard_dtypes": sorted({str(u.shard.dtype) for u in pm.fully_sharded.units})}


def _pp_case(rank, world, gen_dir):
    """pp 2 (a stage per rank, zero groups of one) with bf16 / fp32, 2 micro-batches a step: losses, dtypes."""
    import hf_models
    from nnscaler import ComputeConfig, build_optimizer, parallelize
    pas = {"pipeline_nmicros": 2, "pipeline_scheduler": "1f1b", "zero3_mixed_precision": BF16_FP32}
    cfg = ComputeConfig(2, world, trace_strategy="cpu", use_zero=3, use_end2end=True, pas_config=pas)
    pm = parallelize(hf_models.make("llama", dtype=torch.float32), _micro(0, 0, 0, GLOBAL_BATCH), "pp", cfg,
                     gen_savedir=gen_dir, instance_name="precision_pp2")
    opt = build_optimizer(pm, torch.optim.Adam, lr=LR)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        outputs = pm.train_step([_micro(step, m, 0, GLOBAL_BATCH) for m in range(2)])
        opt.scale_grads(0.5)
        opt.step()
        losses.append(torch.stack([o.detach().float().reshape(()) for o in outputs]).mean().item())
    out = {"losses": losses, "shard_dtypes": sorted({str(u.shard.dtype) for u in pm.fully_sharded.units})}
    # per-unit entries are refused under a pipeline (a stage names its units from what it holds), on every rank
    per_unit = ComputeConfig(2, world, trace_strategy="cpu", use_zero=3, use_end2end=True,
                             pas_config={**pas, "zero3_mixed_precision": HEAD_FP32})
    try:
        parallelize(hf_models.make("llama", dtype=torch.float32), _micro(0, 0, 0, GLOBAL_BATCH), "pp", per_unit,
                    gen_savedir=gen_dir, instance_name="precision_pp2_units")
    except Exception as e:  # noqa: BLE001 - the parent checks the type and message
        out["per_unit"] = f"{type(e).__name__}: {e}"
    return out


def _job(rank, world, gen_dir):
    out = {name: _case(rank, world, gen_dir, name, policy) for name, policy in CASES.items()}
    import warnings
    with warnings.catch_warnings():  # the plan report's: tp splits little of this tiny model
        warnings.simplefilter("ignore")
        out["tp2"] = _tp_case(rank, world, gen_dir)
        out["pp2"] = _pp_case(rank, world, gen_dir)
    return out


@pytest.mark.multiprocess
def test_zero3_mixed_precision_against_one_process(tmp_path):
    results = run_workers(_job, 2, str(tmp_path / "gen"), timeout=600)
    refs = {"bf16": reference(torch.bfloat16, torch.float32), "bf16-bf16": reference(torch.bfloat16, torch.bfloat16),
            "fp32": reference(torch.float32, torch.float32), "head-fp32": reference(head_fp32=True),
            "bf16-accum": reference(micro=2), "tp2": reference(world=1), "pp2": reference(world=1, micro=2),
            "fp16": reference(torch.float16, torch.float32)}
    loss_dtypes = {"head-fp32": "torch.float32", "fp16": "torch.float16"}
    for rank, got in enumerate(results):
        plain, fp32 = got["plain"], got["fp32"]
        # param_dtype float32 is the existing path, exactly
        assert fp32["losses"] == plain["losses"], rank
        assert all(torch.equal(fp32["params"][n], v) for n, v in plain["params"].items()), rank
        for key in ("gather_bytes", "reduce_bytes", "max_gathered_bytes", "loss_dtype"):
            assert fp32[key] == plain[key], (rank, key)
        assert plain["max_gathered_bytes"] == 4 * plain["max_gathered_numel"], rank
        for name in ("bf16", "bf16-bf16", "head-fp32", "bf16-accum", "fp16"):
            case, (ref_losses, ref_params) = got[name], refs[name]
            where = f"{name} rank {rank}"
            assert case["loss_dtype"] == loss_dtypes.get(name, "torch.bfloat16"), where
            # fp32 master shards, gradients and optimizer; bf16 gathers; a read outside forward is fp32
            assert case["shard_dtypes"] == case["grad_dtypes"] == case["optimizer_dtypes"] == ["torch.float32"], where
            assert case["read_dtype"] == "torch.float32", where
            if name == "head-fp32":  # per unit: the head gathered in fp32, every other unit in bf16
                assert case["policies"].pop("model.lm_head") == ("torch.float32", "torch.float32"), where
                assert set(case["policies"].values()) == {("torch.bfloat16", "torch.float32")}, where
                assert got["bf16"]["gather_bytes"] < case["gather_bytes"] < plain["gather_bytes"], where
                assert case["reduce_bytes"] == plain["reduce_bytes"], where
            elif name == "bf16-accum":  # 2 micro-batches a step, the first under no_sync: one reduction a step
                assert case["reduce_bytes"] == plain["reduce_bytes"] and case["gather_bytes"] > got["bf16"]["gather_bytes"]
            else:
                assert case["gather_bytes"] * 2 == plain["gather_bytes"], where
                assert case["max_gathered_bytes"] == 2 * case["max_gathered_numel"] == plain["max_gathered_bytes"] // 2
                want_reduce = plain["reduce_bytes"] if name in ("bf16", "fp16") else plain["reduce_bytes"] // 2
                assert case["reduce_bytes"] == want_reduce, where
            assert case["losses"] == pytest.approx(ref_losses, rel=1e-6, abs=0), (where, case["losses"], ref_losses)
            for n, value in case["params"].items():
                ref = ref_params[n]
                assert value.dtype == torch.float32, (where, n)
                assert ((value - ref).norm() / ref.norm()).item() <= 1e-5, f"{where}: {n}"
        # tensor parallel: traced in bf16 with the tp plan's communication; one process's bf16 losses to a bf16
        # step (tp sums partial products in bf16 where one process's matmul accumulates in fp32)
        tp = got["tp2"]
        assert tp["loss_dtype"] == "torch.bfloat16" and tp["shard_dtypes"] == ["torch.float32"], rank
        assert tp["losses"] == pytest.approx(refs["tp2"][0], rel=8e-3, abs=0), (rank, tp["losses"], refs["tp2"][0])
        # pipelined: each stage traced in bf16, the activations crossing stages bf16; micro-batch gradients summed
        pp = got["pp2"]
        assert pp["shard_dtypes"] == ["torch.float32"], rank
        assert pp["losses"] == pytest.approx(refs["pp2"][0], rel=8e-3, abs=0), (rank, pp["losses"], refs["pp2"][0])
        assert pp.get("per_unit", "").startswith("ConfigError: pas_config['zero3_mixed_precision']['units'] "
                                                 "(model.lm_head) is not supported under a pipeline"), (rank, pp)
        # kept gathered from forward to backward (reshard_after_forward=False): the same run, no gather in backward
        kept, bf16 = got["bf16-kept"], got["bf16"]
        assert kept["losses"] == bf16["losses"], rank
        assert all(torch.equal(kept["params"][n], v) for n, v in bf16["params"].items()), rank
        assert kept["backward_gathers"] == 0 < bf16["backward_gathers"], rank
        assert kept["gather_bytes"] < bf16["gather_bytes"] and kept["reduce_bytes"] == bf16["reduce_bytes"], rank
        # fp32 training (the reference with fp32 everywhere) is not bf16's: close, not equal
        assert plain["losses"] == pytest.approx(refs["fp32"][0], rel=1e-5), rank
        assert got["bf16"]["losses"] != plain["losses"], rank
        assert got["bf16"]["losses"] == pytest.approx(plain["losses"], rel=2e-2), rank
