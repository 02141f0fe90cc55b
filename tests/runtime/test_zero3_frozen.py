"""Frozen parameters (``requires_grad=False``) under ``use_zero=3`` and ZeRO-1: no gradient, no
reduction and no optimizer state for them, and the same training as one process.

One spawn of 2 gloo ranks trains, from the same weights as one process, 3 Adam steps in float64 of
a tiny Hugging Face Llama with a frozen embedding and of the same Llama with LoRA adapters from
`peft` on q_proj / v_proj (every base weight frozen), each under ``use_zero=3`` and
``use_zero=True``: losses and every parameter match one process (1e-10 relative), the frozen
tensors are unchanged and get no gradient, the optimizer holds no piece nor state of them, and
under ``use_zero=3`` their units (a block's frozen tensors are a unit of their own) are never
reduce-scattered and their shards need no gradient; the embedding and the head are units of their
own (the root holds the final norm only). With ``pas_config["zero3_reshard_after_forward"]`` False
for the decoder layers (FSDP2's ``reshard_after_forward``), LoRA under use_zero=3 trains the same
and backward gathers only the head again, nothing staying gathered after backward.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

from launch import run_workers
from parity import one_process_adam

_MODELS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models")
if _MODELS not in sys.path:  # tests/models' Hugging Face builders (here and in the workers)
    sys.path.insert(0, _MODELS)

STEPS = 3
GLOBAL_BATCH = 4
LR = 1e-2
TOL = 1e-10
CASES = [("embed", 3), ("embed", True), ("lora", 3), ("lora", True), ("lora-keep", 3)]
KEEP = {"model.model.layers.*": False}  # "lora-keep": pas_config["zero3_reshard_after_forward"]


def _model(kind: str):
    """A tiny float64 Llama (seeded): its embedding frozen, or LoRA adapters (peft) on q/v with
    their B matrices drawn at random too (peft starts them at zero)."""
    import hf_models
    model = hf_models.make("llama64")
    if kind == "embed":
        model.model.model.embed_tokens.requires_grad_(False)
    else:
        from peft import LoraConfig, get_peft_model
        get_peft_model(model.model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                               target_modules=["q_proj", "v_proj"]))
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def _batch(step: int):
    import hf_models
    return hf_models.batch("llama", step, GLOBAL_BATCH)


def reference(kind: str):
    """One process: (losses, parameters after STEPS steps)."""
    return one_process_adam(_model(kind), _batch, steps=STEPS, lr=LR)


def _case(rank, world, gen_dir, kind, zero):
    from nnscaler import ComputeConfig, build_optimizer, parallelize
    from nnscaler.runtime.optimizer_state import optimizer_state
    model = _model(kind)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    initial = {n: p.detach().clone() for n, p in model.named_parameters() if n in frozen}
    pas = {"zero3_reshard_after_forward": KEEP} if kind == "lora-keep" else {}
    cfg = ComputeConfig(1, world, trace_strategy="cpu", use_zero=zero, pas_config=pas)
    pm = parallelize(model, {k: v[:GLOBAL_BATCH // world] for k, v in _batch(0).items()}, "dp", cfg,
                     gen_savedir=gen_dir, instance_name=f"frozen_{kind.replace('-', '_')}_{int(zero)}")
    opt = build_optimizer(pm, torch.optim.Adam, lr=LR)
    losses, frozen_grads, left, per = [], [], [], GLOBAL_BATCH // world
    for step in range(STEPS):
        opt.zero_grad()
        loss = pm(**{k: v[rank * per:(rank + 1) * per] for k, v in _batch(step).items()})
        loss.backward()
        left += [u.name for u in pm.fully_sharded.units if u.full is not None] if pm.fully_sharded else []
        opt.sync_grads()
        # after backward: the frozen tensors (and under use_zero=3 their shards) got no gradient
        frozen_grads += [p.grad is not None for p in pm.parameters() if not p.requires_grad]
        if pm.fully_sharded is not None:
            frozen_grads += [u.shard.grad is not None for u in pm.fully_sharded.units if not u.trainable]
        opt.step()
        t = loss.detach().reshape(1).clone()
        torch.distributed.all_reduce(t)
        losses.append(t.item() / world)
    out = {"losses": losses, "frozen": sorted(frozen), "frozen_grads": any(frozen_grads), "left": left}
    with pm.unsharded():
        out["params"] = {pm.fullmap[local].full_name: p.detach().clone() for local, p in pm.named_parameters()}
    out["frozen_unchanged"] = all(torch.equal(out["params"][n], v) for n, v in initial.items())
    layout = opt.zero_layout
    out["pieces"] = sorted({p.full_name for p in layout.pieces}) if layout is not None else None
    engine = optimizer_state(opt).zero
    out["optimizer_numel"] = sum(p.numel() for g in opt.param_groups for p in g["params"])
    out["state_numel"] = sum(v.numel() for s in opt.state.values() for k, v in s.items() if k != "step")
    fs = pm.fully_sharded
    if fs is not None:
        out["frozen_units"] = [(u.name, u.trainable, u.shard.requires_grad, sorted(pm.fullmap[n].full_name
                                                                                  for n in u.local_names))
                               for u in fs.units if not u.trainable]
        out["mixed_units"] = [u.name for u in fs.units if len({p.requires_grad for p in u.params}) > 1]
        out["reduce_scatters"] = fs.stats.reduce_scatters
        out["backward_gathers"] = fs.stats.backward_gathers
        out["layer_units"] = sum(u.name.startswith("model.model.layers.") for u in fs.units)
        out["trainable_units"] = sum(u.trainable for u in fs.units)
        out["unit_names"] = sorted({u.name for u in fs.units})
        out["root"] = sorted(pm.fullmap[n].full_name for u in fs.units if u.is_root for n in u.local_names)
    elif engine is not None:
        out["zero1_params_trainable"] = all(zp.param.requires_grad for zp in engine.params)
    return out


def _job(rank, world, gen_dir):
    return {f"{kind}-{zero}": _case(rank, world, gen_dir, kind, zero) for kind, zero in CASES}


@pytest.mark.multiprocess
def test_frozen_parameters_under_zero3_and_zero1(tmp_path):
    refs = {kind: reference(kind) for kind in ("embed", "lora")}
    refs["lora-keep"] = refs["lora"]
    results = run_workers(_job, 2, str(tmp_path / "gen"), timeout=400)
    for kind, zero in CASES:
        ref_losses, ref_params = refs[kind]
        for rank, per_rank in enumerate(results):
            got, where = per_rank[f"{kind}-{zero}"], f"{kind} use_zero={zero} rank {rank}"
            frozen = set(got["frozen"])
            assert frozen and frozen < set(ref_params), where
            if kind == "lora":
                assert all("lora_" not in n for n in frozen) and len(frozen) > len(ref_params) // 2, where
            for s, (a, b) in enumerate(zip(got["losses"], ref_losses)):
                assert abs(a - b) <= TOL * abs(b), f"{where} step {s}: loss {a} vs {b}"
            assert set(got["params"]) == set(ref_params), where
            for name, value in got["params"].items():
                ref = ref_params[name]
                assert ((value - ref).norm() / max(ref.norm(), 1e-30)).item() <= TOL, f"{where}: {name}"
            assert got["frozen_unchanged"] and not got["frozen_grads"], where
            assert got["pieces"] is not None and not frozen & set(got["pieces"]), where  # no optimizer piece
            trainable_numel = sum(v.numel() for n, v in ref_params.items() if n not in frozen)
            assert got["state_numel"] == 2 * got["optimizer_numel"] <= 2 * (trainable_numel // 2 + 64), where
            if zero == 3:
                assert got["mixed_units"] == [], where
                assert got["frozen_units"] and all(not t and not rg for _, t, rg, _ in got["frozen_units"]), where
                assert {n for *_, names in got["frozen_units"] for n in names} == frozen, where
                assert got["reduce_scatters"] == STEPS * got["trainable_units"], where
                # the embedding and the head are units of their own: the root holds the final norm only
                assert {"model.model.embed_tokens", "model.lm_head", "model.model.layers.0"} <= set(
                    got["unit_names"]), where
                assert got["root"] == ["model.model.norm.weight"], where
                assert got["left"] == [], where  # nothing stays gathered after backward
            else:
                assert got["zero1_params_trainable"], where
    for rank, per_rank in enumerate(results):  # lora-keep: the layers stay gathered from forward to backward
        keep, plain = per_rank["lora-keep-3"], per_rank["lora-3"]
        # backward gathers the head and the root (final norm) again, no decoder layer; without the
        # setting also the layers' units (frozen base weights, trainable adapters) backward reads
        assert keep["layer_units"] == 4 and keep["backward_gathers"] == STEPS * 2, (rank, keep)
        assert plain["backward_gathers"] >= STEPS * (2 + 2), (rank, plain)
