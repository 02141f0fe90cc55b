"""The module's random stream on one process (runtime/random.py): the swap leaves the user's
generator alone, seeding, the exact mode against torch.manual_seed, checkpointable state,
recomputation. Multi-process behaviour: test_random_parallel.py."""
from __future__ import annotations

import types

import pytest
import torch

import random_models
from nnscaler import ComputeConfig, parallelize
from nnscaler.runtime import random as nrr

LR = 1e-2


def _pm(tmp_path, name, rng_mode="parallel", user_seed=None, **pas):
    cfg = ComputeConfig(1, 1, trace_strategy="cpu", rng_mode=rng_mode, pas_config=pas)
    model = random_models.make()
    if user_seed is not None:
        torch.manual_seed(user_seed)
    return parallelize(model, random_models.batch(0, 4), "dp", cfg, gen_savedir=tmp_path, instance_name=name)


def _train(model, steps=3, start=0):
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for step in range(start, start + steps):
        device = next(model.parameters()).device
        loss = model(**{k: v.to(device) for k, v in random_models.batch(step, 4).items()})
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


# -- pure functions ------------------------------------------------------------------------------
def test_mix_seed_is_a_63_bit_function_of_all_values():
    seeds = {nrr.mix_seed(s, i) for s in range(50) for i in range(8)}
    assert len(seeds) == 400 and all(0 <= s < 2 ** 63 for s in seeds)
    assert nrr.mix_seed(1, 2) == nrr.mix_seed(1, 2) != nrr.mix_seed(2, 1)


def _fake(dp_size, dp_rank, plan_device):
    grid = types.SimpleNamespace(dp_size=dp_size, dp_rank=dp_rank, plan_device=plan_device)
    return types.SimpleNamespace(grid=grid)


def test_pieces_of_data_and_tensor_parallel_ranks_tile_the_full_tensor():
    full = torch.arange(8 * 6 * 4).view(8, 6, 4)
    for shard, dim in (((0, 2), 0), ((2, 2), 2), (None, None)):
        parts = {}
        for dp_rank in range(2):
            for device in range(2):
                m = _fake(2, dp_rank, device)
                local_shape = nrr.piece(m, full, shard, True).shape
                assert nrr.full_ones(m, torch.empty(local_shape), shard, True).shape == full.shape
                parts[(dp_rank, device)] = nrr.piece(m, full, shard, True)
        # dim 0: the r-th data-parallel block of the global batch, split again inside the unit
        if dim == 0:
            assert torch.equal(torch.cat([parts[(r, d)] for r in range(2) for d in range(2)]), full)
        elif dim == 2:
            rows = [torch.cat([parts[(r, d)] for d in range(2)], dim=2) for r in range(2)]
            assert torch.equal(torch.cat(rows), full)
        else:
            assert torch.equal(torch.cat([parts[(r, 0)] for r in range(2)]), full)
            assert torch.equal(parts[(0, 0)], parts[(0, 1)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("fn", [torch.nn.functional.dropout, torch.nn.functional.dropout2d])
def test_exact_pieces_are_bitwise_the_single_device_dropout(fn, dtype):
    full_x = torch.randn(8, 6, 3, 4).to(dtype)
    torch.manual_seed(0)
    want = fn(full_x, 0.3, True)
    for dp_rank in range(2):
        for device in range(2):
            m = _fake(2, dp_rank, device)
            x = nrr.piece(m, full_x, (1, 2), True)  # this rank's input: batch block, split channels
            torch.manual_seed(0)
            got = x * nrr.piece(m, fn(nrr.full_ones(m, x, (1, 2), True), 0.3, True), (1, 2), True)
            assert torch.equal(got, nrr.piece(m, want, (1, 2), True))


# -- the swap --------------------------------------------------------------------------------------
def test_forward_draws_from_the_module_stream_and_leaves_the_users_alone(tmp_path):
    pm = _pm(tmp_path, "swap")
    b = random_models.batch(0, 4)
    torch.manual_seed(5)
    before = torch.get_rng_state()
    a = pm(**b)
    assert torch.equal(torch.get_rng_state(), before)
    torch.manual_seed(6)  # the user's seed does not change the module's draws
    pm.manual_seed(3)
    first = pm(**b).item()
    torch.manual_seed(7)
    pm.manual_seed(3)
    assert pm(**b).item() == first != a.item()
    # an exception inside forward: the user's state is back too
    torch.manual_seed(5)
    with pytest.raises(Exception):
        pm(idx=b["idx"].float(), targets=b["targets"])
    assert torch.equal(torch.get_rng_state(), before)


def test_seed_comes_from_torch_initial_seed_and_manual_seed(tmp_path):
    pm = _pm(tmp_path, "seed", user_seed=11)
    assert pm.initial_seed() == 11
    b = random_models.batch(0, 4)
    with torch.no_grad():
        pm.manual_seed(3)
        three = [pm(**b).item() for _ in range(3)]
        pm.manual_seed(4)
        four = [pm(**b).item() for _ in range(3)]
        pm.manual_seed(3)
        assert [pm(**b).item() for _ in range(3)] == three != four
    assert pm.initial_seed() == 3
    with pytest.raises(ValueError, match=r"seed must be in \[0, 2\*\*63\)"):
        pm.manual_seed(-1)
    with pytest.raises(TypeError, match="seed must be an int"):
        pm.manual_seed("1")


def test_exact_mode_on_one_process_is_torch_manual_seed(tmp_path):
    pm = _pm(tmp_path, "exact", rng_mode="exact")
    pm.manual_seed(7)
    torch.manual_seed(99)
    got = _train(pm)
    model = random_models.make()
    torch.manual_seed(7)
    want = _train(model)
    assert got == want  # bitwise
    for name, p in model.named_parameters():
        assert torch.equal(p, getattr(pm, name.replace(".", "_"))), name


def test_rng_state_round_trip_resumes_the_same_masks(tmp_path):
    from safetensors.torch import load_file, save_file
    pm = _pm(tmp_path, "state")
    pm.manual_seed(21)
    _train(pm, steps=2)
    state = pm.rng_state()
    assert set(state) == {"seed", "cpu"} and all(isinstance(v, torch.Tensor) for v in state.values())
    save_file(state, str(tmp_path / "rng.safetensors"))  # plain tensors: no pickle
    weights = {k: v.clone() for k, v in pm.state_dict().items()}
    uninterrupted = _train(pm, steps=2, start=2)
    # resume: a fresh module from the same generated class, the weights and the saved stream
    fresh = type(pm)()
    fresh.load_state_dict(weights)
    fresh.load_rng_state(load_file(str(tmp_path / "rng.safetensors")))
    assert fresh.initial_seed() == 21
    assert _train(fresh, steps=2, start=2) == uninterrupted
    with pytest.raises(KeyError, match="load_rng_state: the state lacks seed, cpu"):
        fresh.load_rng_state({})


def test_recomputed_blocks_redraw_the_same_masks(tmp_path):
    for mode in ("parallel", "exact"):
        plain = _pm(tmp_path, f"plain_{mode}", rng_mode=mode)
        recomputed = _pm(tmp_path, f"recompute_{mode}", rng_mode=mode, recompute_modules="Block")
        code = open(__import__("sys").modules[type(recomputed).__module__].__file__).read()
        assert code.count("torch.utils.checkpoint.checkpoint(") == 2
        grads = []
        for pm in (plain, recomputed):
            pm.manual_seed(5)
            loss = pm(**random_models.batch(0, 4))
            loss.backward()
            grads.append((loss.item(), {n: p.grad.clone() for n, p in pm.named_parameters()}))
        assert grads[0][0] == grads[1][0]
        for name, g in grads[0][1].items():
            assert torch.equal(g, grads[1][1][name]), (mode, name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_stream_is_the_cuda_default_generator_of_the_module_device(tmp_path):
    pm = _pm(tmp_path, "cuda", rng_mode="exact")
    assert pm.device.type == "cuda" and "cuda" in pm.rng_state()
    user = torch.cuda.get_rng_state(pm.device)
    pm.manual_seed(7)
    got = _train(pm)
    assert torch.equal(torch.cuda.get_rng_state(pm.device), user)  # the user's CUDA generator untouched
    model = random_models.make().to(pm.device)
    torch.manual_seed(7)
    want = _train(model)
    assert got == want
