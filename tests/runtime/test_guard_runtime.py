"""Guards and both-branch decisions at run time (nnscaler.runtime.guards, nnscaler.ir.branches).

Single process: data that takes another branch than the trace raises GuardError naming the
user's line; `.item()` is guarded on its value. On 2 real gloo processes: a guard that fails on
one data-parallel rank only raises GuardError on every rank (nobody hangs: the run has a
timeout); a pipelined plan fails the step on every rank through its failure notice; the toy of
Hugging Face's mask pattern, traced with padding, trains on padded, unpadded and mixed batches
like one process (float64) under dp 2 and tp 2.
"""
from __future__ import annotations

import copy
import inspect

import pytest
import torch

from guard_models import AssertMask, HFMaskAttention, ItemScale, PipeGuard, mask_batch
from launch import error_of, run_workers

STEPS = 3
LR = 1e-2


def _line_of(cls, text):
    lines, start = inspect.getsourcelines(cls.forward)
    return start + next(i for i, line in enumerate(lines) if text in line)


def _x(seed, n=2):
    return torch.randn(n, 8, generator=torch.Generator().manual_seed(seed))


# -- single process --------------------------------------------------------------------------------

def test_other_branch_raises_guard_error_naming_the_users_line(tmp_path):
    from nnscaler import ComputeConfig, parallelize
    from nnscaler.runtime import GuardError, NnScalerError

    torch.manual_seed(0)
    model = AssertMask()
    ref = copy.deepcopy(model)
    pm = parallelize(model, {"x": _x(0), "mask": torch.ones(2, 8)}, "dp", ComputeConfig(1, 1, trace_strategy="cpu"),
                     gen_savedir=tmp_path, instance_name="assert")
    x = _x(1)
    assert torch.allclose(pm(x, torch.ones(2, 8)), ref(x, torch.ones(2, 8)))  # the traced branch: runs
    mask = torch.ones(2, 8)
    mask[1, 3] = 0
    with pytest.raises(GuardError) as e:
        pm(x, mask)
    msg = str(e.value)
    assert isinstance(e.value, NnScalerError)
    assert f"guard_models.py:{_line_of(AssertMask, 'assert line')}" in msg and "(mask == 1).all()" in msg
    assert "While tracing it was True; it is False now" in msg
    assert "forward's argument `mask`" in msg and "trace with an example that takes the branch" in msg
    assert e.value.__cause__ is None and e.value.__context__ is None  # raised cleanly, nothing chained


def test_item_is_guarded_on_its_value(tmp_path):
    from nnscaler import ComputeConfig, parallelize
    from nnscaler.runtime import GuardError

    torch.manual_seed(0)
    model = ItemScale()
    ref = copy.deepcopy(model)
    pm = parallelize(model, {"x": _x(0), "n": torch.tensor([1, 3])}, "dp", ComputeConfig(1, 1, trace_strategy="cpu"),
                     gen_savedir=tmp_path, instance_name="item")
    x = _x(1)
    same = torch.tensor([3, 2])  # another tensor, same max: the program is right
    assert torch.allclose(pm(x, same), ref(x, same))
    with pytest.raises(GuardError) as e:
        pm(x, torch.tensor([1, 4]))
    msg = str(e.value)
    assert "tensor.item()" in msg and "While tracing it was 3; it is 4 now" in msg
    assert f"guard_models.py:{_line_of(ItemScale, 'item line')}" in msg and "forward's argument `n`" in msg


def test_hf_mask_pattern_traced_with_padding_runs_both_branches(tmp_path):
    from nnscaler import ComputeConfig, parallelize

    torch.manual_seed(0)
    model = HFMaskAttention().double()
    ref = copy.deepcopy(model)
    pm = parallelize(model, mask_batch(0, 4, padded=True), "dp", ComputeConfig(1, 1, trace_strategy="cpu"),
                     gen_savedir=tmp_path, instance_name="hf")
    for step, padded in enumerate([True, False, True, False]):
        batch = mask_batch(step + 1, 4, padded)
        got, want = pm(**batch), ref(**batch)
        got.backward()
        want.backward()
        assert torch.allclose(got, want, rtol=1e-12, atol=0), (padded, got, want)
        assert torch.allclose(pm.qkv_weight.grad, ref.qkv.weight.grad, rtol=1e-10, atol=1e-14)
        pm.zero_grad()
        ref.zero_grad()


# -- two processes -------------------------------------------------------------------------------

def _mixed_batch(step, n):
    """Padding in the first half of the batch only: dp rank 0 pads, rank 1 does not."""
    batch = mask_batch(step, n, padded=False)
    batch["attention_mask"][: n // 2, -2:] = 0
    return batch


BATCHES = {0: lambda s, n: mask_batch(s, n, True), 1: lambda s, n: mask_batch(s, n, False), 2: _mixed_batch}


def _hf_reference(dp):
    torch.manual_seed(0)
    model = HFMaskAttention().double()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        full = BATCHES[step](step, 4)
        per = 4 // dp
        loss = sum(model(**{k: v[r * per:(r + 1) * per] for k, v in full.items()}) for r in range(dp)) / dp
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def _train_hf(rank, world, policy, plan, gen_dir):
    from nnscaler import ComputeConfig, build_optimizer, parallelize
    from parity import train_steps

    dp = world // plan
    torch.manual_seed(0)
    pm = parallelize(HFMaskAttention().double(), mask_batch(0, 4 // dp, True), policy,
                     ComputeConfig(plan, world, trace_strategy="cpu"), gen_savedir=gen_dir,
                     instance_name=f"hf_{policy}_{plan}")
    opt = build_optimizer(pm, torch.optim.Adam, lr=LR)
    losses = train_steps(pm, opt, lambda step, n: BATCHES[step](step, n), steps=STEPS, global_batch=4,
                         dp_rank=rank // plan, dp=dp)
    shards = [(e.full_name, e.full_shape, e.slices, getattr(pm, local).detach().clone())
              for local, e in pm.fullmap.items() if isinstance(getattr(pm, local), torch.nn.Parameter)]
    return losses, shards


def _guard_on_one_rank(rank, world, gen_dir):
    from nnscaler import ComputeConfig, parallelize

    torch.manual_seed(0)
    cfg = ComputeConfig(1, world, trace_strategy="cpu")
    assert_pm = parallelize(AssertMask(), {"x": _x(0), "mask": torch.ones(2, 8)}, "dp", cfg, gen_savedir=gen_dir,
                            instance_name="assert")
    item_pm = parallelize(ItemScale(), {"x": _x(0), "n": torch.tensor([1, 3])}, "dp", cfg, gen_savedir=gen_dir,
                          instance_name="item")
    mask = torch.ones(2, 8)
    if rank == 1:
        mask[0, 0] = 0  # only rank 1's data takes the other branch
    out = {"ok": error_of(lambda: assert_pm(_x(rank), torch.ones(2, 8))),
           "bool": error_of(lambda: assert_pm(_x(rank), mask)),
           "item": error_of(lambda: item_pm(_x(rank), torch.tensor([1, 3 if rank == 0 else 5]))),
           "after": error_of(lambda: assert_pm(_x(rank), torch.ones(2, 8)))}  # the ranks are still in step
    out["hf_dp"] = _train_hf(rank, world, "dp", 1, gen_dir)
    out["hf_tp"] = _train_hf(rank, world, "tp", 2, gen_dir)
    return out


@pytest.mark.multiprocess
@pytest.mark.slow
def test_guards_and_branches_on_two_ranks(tmp_path):
    from parity import assemble_full

    results = run_workers(_guard_on_one_rank, 2, str(tmp_path / "gen"), timeout=240)
    line = f"guard_models.py:{_line_of(AssertMask, 'assert line')}"
    for rank, res in enumerate(results):
        assert res["ok"] is None and res["after"] is None, (rank, res)
        ours, kind, msg = res["bool"]
        assert ours and kind == "GuardError" and line in msg, (rank, msg)
        ours, kind, msg = res["item"]
        assert ours and kind == "GuardError" and "tensor.item()" in msg, (rank, msg)
    assert "it is False now (rank 1)" in results[1]["bool"][2]
    assert "differs now on rank 1 (this rank, 0, matched" in results[0]["bool"][2]
    assert "it is 5 now (rank 1)" in results[1]["item"][2] and "differs now on rank 1" in results[0]["item"][2]
    for key, dp in (("hf_dp", 2), ("hf_tp", 1)):
        ref_losses, ref_params = _hf_reference(dp)
        losses = results[0][key][0]
        assert losses == results[1][key][0]
        for got, want in zip(losses, ref_losses):
            assert abs(got - want) <= 1e-10 * abs(want), (key, losses, ref_losses)
        full = assemble_full(((r, res[key][1]) for r, res in enumerate(results)), key)
        for name, want in ref_params.items():
            err = ((full[name] - want).norm() / want.norm()).item()
            assert err <= 1e-10, (key, name, err)


def _pipelined_guard(rank, world, gen_dir):
    from nnscaler import ComputeConfig, parallelize

    torch.manual_seed(0)
    cfg = ComputeConfig(2, 2, trace_strategy="cpu", use_end2end=True,
                        pas_config={"pipeline_nmicros": 2, "pipeline_scheduler": "1f1b"})
    pm = parallelize(PipeGuard(), {"x": _x(0), "mask": torch.ones(2, 8)}, "pp", cfg, gen_savedir=gen_dir)
    bad = torch.ones(2, 8)
    bad[1, 1] = 0
    ok = error_of(lambda: pm.train_step([{"x": _x(1), "mask": torch.ones(2, 8)}] * 2))
    failed = error_of(lambda: pm.train_step([{"x": _x(2), "mask": torch.ones(2, 8)}, {"x": _x(3), "mask": bad}]))
    _store_barrier(world)  # both stay alive until both are done; a rank left waiting would time out the run
    return dict(ok=ok, failed=failed)


def _store_barrier(world):
    """Wait for every rank through the rendezvous store (a gloo barrier would sit behind the
    failed step's abandoned messages)."""
    import time
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    store.add("guard_test_done", 1)
    while store.add("guard_test_done", 0) < world:
        time.sleep(0.05)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_pipelined_guard_fails_the_step_on_every_rank(tmp_path):
    first, last = run_workers(_pipelined_guard, 2, str(tmp_path / "gen"), timeout=90)
    assert first["ok"] is None and last["ok"] is None
    failed = [r["failed"] for r in (first, last)]
    assert all(f is not None and f[0] for f in failed), failed
    line = f"guard_models.py:{_line_of(PipeGuard, 'pipelined guard line')}"
    own = next(f for f in failed if f[1] == "GuardError")  # the stage that runs the guard
    assert line in own[2] and "it is False now" in own[2], own
    other = next(f for f in failed if f is not own)  # told by the failure notice, not left waiting
    assert other[1] == "NnScalerError" and "pipeline rank 1 failed in stage 1, micro-batch 1" in other[2], other


# -- Hugging Face Llama (tiny, built in code, float64) ---------------------------------------------

class _Llama(torch.nn.Module):
    def __init__(self):
        super().__init__()
        import transformers
        cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                       attn_implementation="sdpa")
        self.model = transformers.LlamaForCausalLM(cfg)

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids, use_cache=False).loss


def _llama_batch(seed, padded):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (4, 8), generator=g)
    mask = torch.ones(4, 8, dtype=torch.long)
    if padded:
        mask[1, 6:] = 0
        mask[3, 5:] = 0
    return {"input_ids": ids, "attention_mask": mask}


@pytest.mark.parametrize("traced_padded", [False, True])
def test_hf_llama_padding(tmp_path, traced_padded):
    from nnscaler import ComputeConfig, parallelize
    from nnscaler.runtime import GuardError

    torch.manual_seed(0)
    model = _Llama().double()
    ref = copy.deepcopy(model)
    pm = parallelize(model, _llama_batch(0, traced_padded), "dp", ComputeConfig(1, 1, trace_strategy="cpu"),
                     gen_savedir=tmp_path, instance_name=f"llama_{traced_padded}")
    for step, padded in enumerate([traced_padded, not traced_padded, traced_padded]):
        batch = _llama_batch(step + 1, padded)
        want = ref(**batch)
        if padded and not traced_padded:  # traced unpadded: the padded batch is refused, never silently wrong
            with pytest.raises(GuardError) as e:
                pm(**batch)
            msg = str(e.value)
            assert "masking_utils.py" in msg and "modeling_llama.py" in msg, msg  # the library and the model line
            assert "forward's argument `attention_mask`" in msg and "it is False now" in msg, msg
            continue
        got = pm(**batch)
        got.backward()
        want.backward()
        assert torch.allclose(got, want, rtol=1e-12, atol=0), (step, padded, got.item(), want.item())
        grad, ref_grad = pm.model_model_layers_0_self_attn_q_proj_weight.grad, \
            ref.model.model.layers[0].self_attn.q_proj.weight.grad
        assert torch.allclose(grad, ref_grad, rtol=1e-10, atol=1e-14), (step, padded)
        pm.zero_grad()
        ref.zero_grad()
