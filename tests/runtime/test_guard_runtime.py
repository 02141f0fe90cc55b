"""Guards and both-branch decisions at run time (nnscaler.runtime.guards, nnscaler.ir.tracer.branches).

Single process: `check` itself; data that takes another branch than the trace raises GuardError
naming the user's line; `.item()` is guarded on its value; the toy of Hugging Face's mask pattern
and a tiny Hugging Face Llama, traced with padding, run padded and unpadded batches like the
model itself. Two processes: test_guard_runtime_mp.py.
"""
from __future__ import annotations

import copy
import inspect
import warnings

import pytest
import torch

from guard_models import AssertMask, HFMaskAttention, ItemScale, LoopDecisions, NumpyScale, mask_batch



def _line_of(cls, text):
    lines, start = inspect.getsourcelines(cls.forward)
    return start + next(i for i, line in enumerate(lines) if text in line)


def _x(seed, n=2):
    return torch.randn(n, 8, generator=torch.Generator().manual_seed(seed))


# -- check() ------------------------------------------------------------------------------------

def test_check_compares_what_was_read():
    from nnscaler.runtime.guards import GuardError, check

    check(torch.tensor(True), "bool", True)
    check(torch.tensor(3), "item", 3)
    check(torch.tensor(1.0, dtype=torch.float32) + 1e-7, "float", 1.0)  # another summation order
    check(torch.tensor([[1, 2], [3, 4]]), "tolist", [[1, 2], [3, 4]])
    big = torch.arange(2000.0)
    from nnscaler.ir.tracer.guards import digest
    check(big, "array", {"digest": digest(big)})
    check(None, "bool", False)  # a guard inside a branch this rank's data did not take: nothing to check
    for value, read, traced in [(torch.tensor(False), "bool", True), (torch.tensor(4), "item", 3),
                                (torch.tensor(1.01), "float", 1.0), (torch.tensor([1, 2]), "tolist", [1, 3]),
                                (big.flip(0), "array", {"digest": digest(big)})]:
        with pytest.raises(GuardError) as e:
            check(value, read, traced, at="model.py:3 in forward: if m.all():", cause="forward's argument `m`")
        msg = str(e.value)
        assert "model.py:3 in forward: if m.all():" in msg and "forward's argument `m`" in msg, msg
        assert f"While tracing it was {traced!r}" in msg or "the traced tensor" in msg, msg


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


def test_numpy_round_trip_is_guarded_on_its_value(tmp_path):
    """`.numpy()` / `np.asarray` used to freeze the example's values into the program silently."""
    from nnscaler import ComputeConfig, parallelize
    from nnscaler.runtime import GuardError

    torch.manual_seed(0)
    model = NumpyScale()
    ref = copy.deepcopy(model)
    pm = parallelize(model, {"x": _x(0), "n": torch.tensor([1, 3])}, "dp", ComputeConfig(1, 1, trace_strategy="cpu"),
                     gen_savedir=tmp_path, instance_name="numpy")
    x = _x(1)
    same = torch.tensor([1, 3])
    assert torch.allclose(pm(x, same), ref(x, same))
    with pytest.raises(GuardError) as e:
        pm(x, torch.tensor([1, 4]))  # max 4 instead of 3: the frozen program would scale by 3
    msg = str(e.value)
    assert "a tensor turned into a NumPy array" in msg and "forward's argument `n`" in msg
    assert f"guard_models.py:{_line_of(NumpyScale, 'numpy line')}" in msg


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


def test_chained_decisions_are_right_or_refused_never_silently_wrong(tmp_path):
    from nnscaler import ComputeConfig, parallelize
    from nnscaler.runtime import GuardError

    torch.manual_seed(0)
    model = LoopDecisions()
    ref = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = parallelize(model, {"x": torch.full((2, 3), 5.0)}, "dp", ComputeConfig(1, 1, trace_strategy="cpu"),
                         gen_savedir=tmp_path, instance_name="loop")
    ran = refused = 0
    for seed in range(40):
        x = torch.randn(2, 3, generator=torch.Generator().manual_seed(seed)) * 3
        try:
            got = pm(x)
        except GuardError:
            refused += 1
            continue
        ran += 1
        assert torch.allclose(got, ref(x)), seed
    assert ran > 0 and refused > 0 and ran + refused == 40  # both happen: more than the traced path runs


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
    """Traced with or without padding, padded and unpadded batches both match the model: both
    branches of masking_utils' decisions are in the program (the padded branch's own decision is
    flipped with the first, see nnscaler.ir.tracer.branches)."""
    from nnscaler import ComputeConfig, parallelize

    torch.manual_seed(0)
    model = _Llama().double()
    ref = copy.deepcopy(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm = parallelize(model, _llama_batch(0, traced_padded), "dp", ComputeConfig(1, 1, trace_strategy="cpu"),
                         gen_savedir=tmp_path, instance_name=f"llama_{traced_padded}")
    told = [str(w.message) for w in caught if "masking_utils.py" in str(w.filename)]
    assert told and "both branches are generated" in told[0] and "modeling_llama.py" in told[0], told
    assert "forward's argument `attention_mask`" in told[0]
    for step, padded in enumerate([traced_padded, not traced_padded, traced_padded, not traced_padded]):
        batch = _llama_batch(step + 1, padded)
        got, want = pm(**batch), ref(**batch)
        got.backward()
        want.backward()
        assert torch.allclose(got, want, rtol=1e-12, atol=0), (step, padded, got.item(), want.item())
        grad, ref_grad = pm.model_model_layers_0_self_attn_q_proj_weight.grad, \
            ref.model.model.layers[0].self_attn.q_proj.weight.grad
        assert torch.allclose(grad, ref_grad, rtol=1e-10, atol=1e-14), (step, padded)
        pm.zero_grad()
        ref.zero_grad()
