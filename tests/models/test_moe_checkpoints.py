"""Checkpoints of mixture-of-experts training: a checkpoint saved under ``ep`` 2 x dp 2 (each rank
holding half the experts) merges to the model's own names and layout, ``merge(hf=True)`` gives a
directory ``from_pretrained`` loads, and the checkpoint loads under ``ep`` 4 (one expert per rank),
``ep`` 4 with ``ep_size`` 2, ``ep`` 1 and ``dp`` on 4 processes: every plan then computes the same loss on the same batch as the
merged model in one process (float64, 1e-10), and the expert weights it holds are the slices of the
merged ones; loaded under ``ep`` 4 with ``ep_size`` 2 (each rank storing 1/4 of the experts) and saved
again, it merges to the same weights. One spawn of 4 processes runs it all."""
from __future__ import annotations

import os

import pytest
import torch

import hf_models
from launch import run_workers

TOL = 1e-10
PLANS = [("ep4", "ep", 4), ("ep4-ep2", "ep", 4), ("ep1", "ep", 1), ("dp", "dp", 1)]
PAS = {"ep4-ep2": {"ep_size": 2}}  # each rank stores 1/4 of the experts, tokens exchanged inside pairs


def _parallel(name, policy, plan, world, root):
    from nnscaler import ComputeConfig, parallelize
    sample = hf_models.batch("mixtral", 0, 4 // (world // plan))
    cfg = ComputeConfig(plan, world, trace_strategy="cpu", pas_config=PAS.get(name, {}))
    return parallelize(hf_models.make("mixtral"), sample, policy, cfg,
                       gen_savedir=os.path.join(root, "gen", name), instance_name=f"mixtral_{name}".replace("-", "_"))


def _work(rank, world, root):
    import torch.distributed as dist
    from nnscaler import build_optimizer
    from nnscaler.ckpt import HF_EXTRA_KEY, HFRecord, load, merge, save
    pm = _parallel("ep2", "ep", 2, world, root)
    opt = build_optimizer(pm, torch.optim.Adam, lr=1e-3)
    full = hf_models.batch("mixtral", 0, 4)
    unit = rank // 2
    pm(**{k: v[unit * 2:(unit + 1) * 2] for k, v in full.items()}).backward()
    opt.step()  # the experts now differ from their initial values
    model = hf_models.make("mixtral").model
    record = HFRecord(config=model.config.to_json_string(), prefix="model.", tied=tuple(model.all_tied_weights_keys))
    ck = os.path.join(root, "ep2")
    save(ck, pm, opt, extra={HF_EXTRA_KEY: record.to_extra()})
    local = {pm.fullmap[n].full_name: tuple(p.shape) for n, p in pm.named_parameters() if ".experts." in pm.fullmap[n].full_name}
    losses = {}
    for name, policy, plan in PLANS:
        other = _parallel(name, policy, plan, world, root)
        load(ck, other)
        with torch.no_grad():
            losses[name] = float(other(**full))
        experts = {other.fullmap[n].full_name: (other.fullmap[n].slices, p.detach().clone())
                   for n, p in other.named_parameters() if ".experts." in other.fullmap[n].full_name}
        losses[name + "-experts"] = experts
        if name in PAS:  # saved again under ep_size 2: merges to the same weights
            save(os.path.join(root, name), other)
    if rank == 0:
        merge(ck, os.path.join(root, "merged"), model_only=True)
        merge(ck, os.path.join(root, "hf"), hf=True)
        for name in PAS:
            merge(os.path.join(root, name), os.path.join(root, "merged-" + name), model_only=True)
    dist.barrier()
    return local, losses


@pytest.mark.multiprocess
@pytest.mark.slow
def test_moe_checkpoint_round_trips(tmp_path):
    from safetensors.torch import load_file
    import transformers
    results = run_workers(_work, 4, str(tmp_path), timeout=400)
    merged = load_file(str(tmp_path / "merged" / "model.safetensors"))
    reference = hf_models.make("mixtral")
    assert set(merged) == {f"model.{k}" for k in reference.model.state_dict()}  # the model's own names
    for name, value in reference.model.state_dict().items():
        assert tuple(merged[f"model.{name}"].shape) == tuple(value.shape), name
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float64,
                                                               experts_implementation="eager")  # grouped_mm: no float64
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, merged[f"model.{name}"]), name
    for name in PAS:
        again = load_file(str(tmp_path / f"merged-{name}" / "model.safetensors"))
        assert set(again) == set(merged) and all(torch.equal(again[k], merged[k]) for k in merged), name
    model = hf_models._same_dtype_rms_norm(hf_models.MoeCausalLM(loaded))
    with torch.no_grad():
        want = float(model(**hf_models.batch("mixtral", 0, 4)))
    for rank, (local, losses) in enumerate(results):
        assert local and all(shape[0] == merged[n].shape[0] // 2 for n, shape in local.items()), local
        for name, _, plan in PLANS:
            assert abs(losses[name] - want) <= TOL * abs(want), (rank, name, losses[name], want)
            for full_name, (slices, value) in losses[name + "-experts"].items():
                piece = merged[full_name][tuple(slice(a, b) for a, b in slices)]
                assert torch.equal(value, piece), (name, full_name)
                assert value.shape[0] == merged[full_name].shape[0] // plan
