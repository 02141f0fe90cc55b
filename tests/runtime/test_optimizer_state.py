"""One owner of nnscaler's state (`nnscaler.runtime.optimizer_state`): build_optimizer,
with_master_weights, offload_optimizer and apply_precision stamp nothing on the torch objects they
are given (only the mixed-in class), and what they keep is found through `optimizer_state` /
`module_state`, also from a wrapper that holds the optimizer as ``_optimizer`` (Lightning's)."""
from __future__ import annotations

import copy

import torch

from test_module import LR, batch, gen_class, initial_state
from nnscaler.runtime import apply_precision, module_state, optimizer_state, with_master_weights
from nnscaler.runtime.offload import offload_optimizer
from nnscaler.runtime.optimizer import build_optimizer
from nnscaler.runtime.precision import get_precision, remove_precision


def _pm(**config):
    pm = gen_class(**config)()
    pm.load_full_state(initial_state())
    return pm


def test_nothing_is_stamped_on_the_optimizer_or_the_module():
    for config in ({}, {"use_zero": True}, {"use_zero": 3}):
        pm = _pm(**config)
        before = set(vars(pm))
        fresh = set(vars(torch.optim.Adam([torch.zeros(1, requires_grad=True)], lr=LR)))
        opt = offload_optimizer(build_optimizer(pm, torch.optim.Adam, lr=LR))
        opt.zero_grad()
        pm(**batch(0)).backward()
        opt.clip_gnorm(1.0)
        opt.step()
        assert set(vars(opt)) <= fresh, set(vars(opt)) - fresh
        assert set(vars(pm)) == before, set(vars(pm)) ^ before
        state = optimizer_state(opt)
        assert state.module is pm and state.grid is pm.grid and state.offload is not None
        assert (state.zero is None) == (not config) and opt.zero_layout is (state.zero.layout if config else None)
        assert module_state(pm) is not None and module_state(pm).plain_reducer is None


def test_master_copies_are_recorded_not_stamped():
    pm = _pm()
    pm.to(torch.bfloat16)
    opt = with_master_weights(build_optimizer(pm, torch.optim.Adam, lr=LR))
    masters = optimizer_state(opt).masters
    assert [m for _, m in masters.pairs] == opt.master_params and not masters.grads_ready
    assert all(id(m) in optimizer_state(opt).replicas for m in opt.master_params)
    plain = with_master_weights(torch.optim.SGD([torch.zeros(2, dtype=torch.bfloat16, requires_grad=True)], lr=1))
    assert optimizer_state(plain).module is None and len(optimizer_state(plain).masters.pairs) == 1


def test_a_wrapper_holding_the_optimizer_finds_its_state():
    pm = _pm()
    opt = build_optimizer(pm, torch.optim.Adam, lr=LR)

    class Wrapper:
        def __init__(self, inner):
            self._optimizer = inner

    assert optimizer_state(Wrapper(opt)) is optimizer_state(opt)
    assert optimizer_state(Wrapper(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1))) is None


def test_precision_travels_with_the_module_in_its_hooks():
    m = torch.nn.Linear(2, 2)
    apply_precision(m, "bf16-mixed")
    assert set(vars(m)) == set(vars(torch.nn.Linear(2, 2)))
    twin = copy.deepcopy(m)
    assert get_precision(twin) == get_precision(m) is not None
    remove_precision(twin)
    assert get_precision(twin) is None and not twin._forward_pre_hooks and not twin._forward_hooks
    assert get_precision(m) is not None
