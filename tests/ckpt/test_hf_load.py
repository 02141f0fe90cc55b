"""nnscaler.ckpt.load from a Hugging Face model directory (ckpt/hf_load.py), single process: a
module built on the meta device and parallelized takes the values `save_pretrained` wrote (one
file and sharded with an index), under the files' names as they are or under one common prefix;
missing, unexpected and mis-shaped tensors, an ambiguous prefix and an optimizer are refused by
name; a Qwen3-MoE directory (experts stored one by one) fills the module's fused expert tensors as
``from_pretrained`` does, and a missing expert tensor is refused by name. One launch of 2 gloo
processes: a meta-built Llama (float64) loads the directory and an nnscaler checkpoint into dp, tp,
ZeRO-1, ZeRO-3, cp (ring attention) and pp (1f1b) plans and trains as one process does (1e-10); a
Mixtral built on meta and initialized on the ranks trains under ep 2 as one process does, and a
meta-built Mixtral loads its ``save_pretrained`` directory (per-expert names) under ep 2, each rank
reading only its experts, to ``from_pretrained``'s values exactly."""
from __future__ import annotations

import contextlib
import os
import sys

import pytest
import torch
import torch.nn as nn
from safetensors.torch import save_file

import nnscaler.ckpt as ckpt
from nnscaler import ComputeConfig, parallelize
from nnscaler.ckpt import CheckpointError
from nnscaler.ckpt.hf_load import is_hf_directory, match_prefix
from nnscaler.ckpt.module_tensors import local_tensors

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models"))
import hf_models  # noqa: E402
import model_plans as mp  # noqa: E402
from launch import run_workers  # noqa: E402
from parity import assemble_full  # noqa: E402

IDS = torch.randint(0, hf_models.VOCAB, (2, hf_models.SEQ), generator=torch.Generator().manual_seed(0))
ARGS = {"input_ids": IDS, "labels": IDS}


def _meta_llama(tmp_path):
    with torch.device("meta"):
        model = hf_models.llama()
    return parallelize(model, ARGS, "dp", ComputeConfig(1, 1), gen_savedir=tmp_path / "gen",
                       init_module_params=False)


@pytest.mark.parametrize("shard", [None, "20KB"])
def test_meta_llama_loads_save_pretrained_directory(tmp_path, shard):
    torch.manual_seed(5)
    reference = hf_models.llama()
    kw = {} if shard is None else {"max_shard_size": shard}
    reference.model.save_pretrained(tmp_path / "hf", **kw)  # names without the wrapper's "model."
    assert is_hf_directory(tmp_path / "hf")
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists() == (shard is not None)
    pm = _meta_llama(tmp_path)
    assert ckpt.load(tmp_path / "hf", pm) is None
    state = {**dict(reference.named_parameters()), **dict(reference.named_buffers())}
    for local, e in pm.fullmap.items():
        assert torch.equal(getattr(pm, local), state[e.full_name]), e.full_name
    assert torch.equal(pm(**ARGS), reference(**ARGS))


def _write(path, tensors):
    path.mkdir()
    save_file(tensors, str(path / "model.safetensors"))


def _llama_state(prefix=""):
    model = hf_models.llama()
    return {k[len(prefix):]: v.contiguous() for k, v in model.state_dict().items() if k.startswith(prefix)}


def test_missing_unexpected_and_shapes_are_named(tmp_path):
    pm = _meta_llama(tmp_path)
    state = _llama_state("model.")
    missing = dict(state)
    del missing["model.norm.weight"]
    _write(tmp_path / "missing", missing)
    with pytest.raises(CheckpointError, match=r"does not hold this model \(the module's names under the prefix "
                                              r"'model.'\): missing model.model.norm.weight\[32\]"):
        ckpt.load(tmp_path / "missing", pm)
    _write(tmp_path / "unexpected", {**state, "model.extra.weight": torch.zeros(2)})
    with pytest.raises(CheckpointError, match=r"unexpected model.extra.weight: load the Hugging Face directory"):
        ckpt.load(tmp_path / "unexpected", pm)
    _write(tmp_path / "shape", {**state, "model.norm.weight": torch.zeros(31)})
    with pytest.raises(CheckpointError, match=r"model.norm.weight has shape \[31\] in the directory, the module's "
                                              r"model.model.norm.weight \[32\]"):
        ckpt.load(tmp_path / "shape", pm)
    _write(tmp_path / "good", state)
    local = next(n for n, e in pm.fullmap.items() if e.full_name == "model.model.norm.weight")
    before = getattr(pm, local).clone()
    with pytest.raises(CheckpointError, match="holds no optimizer state; call nnscaler.ckpt.load"):
        ckpt.load(tmp_path / "good", pm, torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1))
    assert torch.equal(getattr(pm, local), before)  # nothing changed
    ckpt.load(tmp_path / "good", pm)
    assert torch.equal(getattr(pm, local), state["model.norm.weight"])


def test_names_as_they_are_and_under_one_prefix():
    files = {"a.weight", "b.weight"}
    assert match_prefix(["a.weight", "b.weight"], files, "d") == ""
    assert match_prefix(["m.a.weight", "m.b.weight"], files, "d") == "m."
    assert match_prefix(["m.inner.a.weight", "m.inner.b.weight", "x"], files, "d") == "m.inner."
    with pytest.raises(CheckpointError, match=r"equally well under the prefixes 'p.', 'q.'"):
        match_prefix(["p.a.weight", "q.b.weight"], files, "d")
    with pytest.raises(CheckpointError, match="none of the module's tensors"):
        match_prefix(["c.weight"], files, "d")


def _meta_pm(name, tmp_path, policy="dp", cfg=None):
    with torch.device("meta"), _default_dtype(torch.float64):
        model = hf_models.BUILDERS[name]()
    return parallelize(model, hf_models.batch(name, 0, 2), policy, cfg or ComputeConfig(1, 1),
                       gen_savedir=tmp_path / "gen", init_module_params=False)


def _from_pretrained(name, path):
    """The model transformers loads from `path` (its own per-expert -> fused conversion), by name."""
    model = type(hf_models.make(name).model).from_pretrained(path, dtype=torch.float64)
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def test_experts_stored_one_by_one_fill_the_fused_tensors(tmp_path):
    hf_models.make("qwen3_moe").model.save_pretrained(tmp_path / "hf")  # transformers 5 writes experts one by one
    from safetensors import safe_open
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in keys and not any("gate_up_proj" in k for k in keys)
    pm = _meta_pm("qwen3_moe", tmp_path)
    ckpt.load(tmp_path / "hf", pm)
    want = _from_pretrained("qwen3_moe", tmp_path / "hf")
    fused = [e.full_name for e in pm.fullmap.values() if e.full_name.endswith(("gate_up_proj", "down_proj"))]
    assert len(fused) == 4
    for local, e in pm.fullmap.items():
        assert torch.equal(getattr(pm, local), want[e.full_name[len("model."):]]), e.full_name
    # one expert's up projection missing: refused by name, with the fix, and nothing changed
    from safetensors.torch import load_file
    state = load_file(str(tmp_path / "hf" / "model.safetensors"))
    del state["model.layers.1.mlp.experts.2.up_proj.weight"]
    _write(tmp_path / "lacking", state)
    before = {local: getattr(pm, local).clone() for local in pm.fullmap}
    with pytest.raises(CheckpointError, match=r"model.layers.1.mlp.experts.gate_up_proj is stored per expert, and the "
                                              r"directory lacks model.layers.1.mlp.experts.2.up_proj.weight: copy "
                                              r"the model's files completely \(every expert's gate_proj and "
                                              r"up_proj\)") as info:
        ckpt.load(tmp_path / "lacking", pm)
    assert "Traceback" not in str(info.value)
    assert all(torch.equal(getattr(pm, local), v) for local, v in before.items())


def test_a_checkpoint_directory_is_not_taken_for_hugging_face(tmp_path):
    _write(tmp_path / "hf", {"w": torch.zeros(1)})
    assert is_hf_directory(tmp_path / "hf")
    (tmp_path / "hf" / "manifest.json").write_text("{}")  # a merged nnscaler checkpoint has one
    assert not is_hf_directory(tmp_path / "hf")
    assert not is_hf_directory(tmp_path / "nothing")


PLANS = [("dp", "dp", 1, {}), ("tp", "tp", 2, {}), ("zero3", "dp", 1, {"use_zero": 3}),
         ("zero1", "dp", 1, {"use_zero": True}), ("cp", "cp", 2, {}),
         ("pp", "pp", 2, {"use_end2end": True, "pas_config": {"pipeline_nmicros": mp.NMICROS,
                                                             "pipeline_scheduler": "1f1b"}})]


@contextlib.contextmanager
def _default_dtype(dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


@contextlib.contextmanager
def _counting_reads():
    """[elements read from checkpoint files] while inside (every read goes through Sources.read_key)."""
    from nnscaler.ckpt.sources import Sources
    count, original = [0], Sources.read_key

    def counted(self, file, key, region=None):
        out = original(self, file, key, region)
        count[0] += out.numel()
        return out
    Sources.read_key = counted
    try:
        yield count
    finally:
        Sources.read_key = original


def _meta_plans(rank, world, hf_dir, root, moe_dir):
    """Every plan from each source: (losses, this rank's parameter pieces) by "<plan>-<source>"."""
    out, ckpt_dir = {}, os.path.join(root, "ckpt")
    for label, policy, plan_ngpus, extra in PLANS:
        for source in ("hf", "ckpt"):
            with torch.device("meta"):
                model = hf_models.make("llama64")
            per, dp_rank = mp.GLOBAL_BATCH // (world // plan_ngpus), rank // plan_ngpus
            cfg = ComputeConfig(plan_ngpus, world, **extra)
            sample = hf_models.batch("llama64", 0, per // mp.NMICROS if cfg.use_end2end else per)
            pm = parallelize(model, sample, policy, cfg, gen_savedir=os.path.join(root, label), init_module_params=False)
            assert all(p.is_meta for p in model.parameters())
            if cfg.zero_stage == 3:  # only the shards were allocated: every registered parameter is empty
                fs = pm.fully_sharded
                assert fs.sharded and all(p.numel() == 0 and not p.is_meta for p in pm.parameters())
                assert sum(u.shard.numel() for u in fs.units) <= sum(u.padded for u in fs.units) // world
            with _counting_reads() as read:
                assert ckpt.load(hf_dir if source == "hf" else ckpt_dir, pm) is None
            held = sum(t.numel() for lt in local_tensors(pm) if lt.persistent for _, t in lt.pieces())
            if source == "hf":  # only the regions this rank holds are read, a fraction under tp, ZeRO-3, pp
                assert read[0] <= held, (label, read[0], held)
                assert (held < sum(p.numel() for p in model.parameters())) == (label in ("tp", "zero3", "pp")), label
            if label == "dp" and source == "hf":  # the nnscaler checkpoint the other plans load
                ckpt.save(ckpt_dir, pm)
            out[f"{label}-{source}"] = _train(pm, cfg, "llama64", per, dp_rank, world)
    # a mixture of experts under ep 2, initialized on the ranks (the CPU build's values with the same seed)
    with torch.device("meta"), _default_dtype(torch.float64):
        model = hf_models.make("mixtral")  # seeds 0, as the reference's CPU build (in float64 from the start)
    cfg = ComputeConfig(2, world)
    pm = parallelize(model, hf_models.batch("mixtral", 0, mp.GLOBAL_BATCH), "ep", cfg,
                     gen_savedir=os.path.join(root, "ep"))
    out["ep-init"] = _train(pm, cfg, "mixtral", mp.GLOBAL_BATCH, 0, world)
    # the same model from its save_pretrained directory (experts one by one): each rank reads its experts
    with torch.device("meta"), _default_dtype(torch.float64):
        model = hf_models.make("mixtral")
    pm = parallelize(model, hf_models.batch("mixtral", 0, mp.GLOBAL_BATCH), "ep", cfg,
                     gen_savedir=os.path.join(root, "ep"), init_module_params=False)
    with _counting_reads() as read:
        ckpt.load(moe_dir, pm)
    held = sum(t.numel() for lt in local_tensors(pm) if lt.persistent for _, t in lt.pieces())
    experts = [lt for lt in local_tensors(pm) if lt.full_name.endswith("gate_up_proj")]
    assert experts and all(lt.slices[0][1] - lt.slices[0][0] == 2 for lt in experts)  # 2 of the 4 experts
    out["ep-hf"] = (read[0], held, [(e.full_name, e.full_shape, e.slices, getattr(pm, local).detach().clone())
                                    for local, e in pm.fullmap.items()])
    return out


def _train(pm, cfg, name, per, dp_rank, world):
    """STEPS Adam steps of `pm` on this rank's slice of each global batch: (mean losses, pieces)."""
    import torch.distributed as dist
    from nnscaler import build_optimizer
    opt = build_optimizer(pm, torch.optim.Adam, lr=mp.LR)
    losses = []
    for step in range(mp.STEPS):
        full = hf_models.batch(name, step, mp.GLOBAL_BATCH)
        mine = {k: v[dp_rank * per:(dp_rank + 1) * per] for k, v in full.items()}
        opt.zero_grad()
        if cfg.use_end2end:  # the pipeline: micro-batches, gradients averaged over them
            outputs = pm.train_step(mp._micro(mine, mp.NMICROS))
            opt.scale_grads(1.0 / mp.NMICROS)
            loss = torch.stack([o.detach().reshape(()) for o in outputs]).mean()
        else:
            loss = pm(**mine)
            loss.backward()
        opt.step()
        t = loss.detach().reshape(1).clone()
        dist.all_reduce(t)
        losses.append(t.item() / world)
    with pm.unsharded():
        pieces = [(e.full_name, e.full_shape, e.slices, getattr(pm, local).detach().clone())
                  for local, e in pm.fullmap.items() if isinstance(getattr(pm, local), torch.nn.Parameter)]
    return losses, pieces


@pytest.mark.multiprocess
def test_meta_llama_from_hf_directory_and_checkpoint_trains_as_one_process(tmp_path):
    hf_models.make("llama64").model.save_pretrained(tmp_path / "hf")
    hf_models.make("mixtral").model.save_pretrained(tmp_path / "moe")  # block_sparse_moe.experts.<e>.w1 ...
    results = run_workers(_meta_plans, 2, str(tmp_path / "hf"), str(tmp_path), str(tmp_path / "moe"), timeout=360)
    want = _from_pretrained("mixtral", tmp_path / "moe")
    loaded = [r.pop("ep-hf") for r in results]
    assert all(read <= held for read, held, _ in loaded), loaded  # each rank read only its experts and regions
    moe = assemble_full(((r, pieces) for r, (_, _, pieces) in enumerate(loaded)), "ep-hf")
    assert {n[len("model."):] for n in moe} == set(want)
    for name, value in moe.items():
        assert torch.equal(value, want[name[len("model."):]]), name
    refs = {"llama64": mp.reference("llama64")}
    with _default_dtype(torch.float64):  # the initialisation draws in the dtype the model is built in
        refs["mixtral"] = mp.reference("mixtral")
    for label in results[0]:
        ref_losses, ref_params = refs["mixtral" if label == "ep-init" else "llama64"]
        losses = results[0][label][0]
        assert all(r[label][0] == losses for r in results), label
        for got, want in zip(losses, ref_losses):
            assert abs(got - want) <= 1e-10 * max(1.0, abs(want)), (label, losses, ref_losses)
        params = assemble_full(((r, per_rank[label][1]) for r, per_rank in enumerate(results)), label)
        assert set(params) == set(ref_params), label
        for name, value in params.items():
            assert (value - ref_params[name]).abs().max().item() <= 1e-10, (label, name)
    assert len(results[0]) == 2 * len(PLANS) + 1
