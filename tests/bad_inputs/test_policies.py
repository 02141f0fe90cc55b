"""Policies given a model or batch they cannot split, and user policies that fail."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

from nnscaler.ir import ComputeConfig, trace
from nnscaler.policies import apply_policy
from nnscaler.policies import PolicyWarning


class Odd(nn.Module):
    """Every size odd: nothing divides by 2."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 3)

    def forward(self, x):
        return torch.logcumsumexp(self.fc(x), dim=-1).sum()


class Even(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x).sum()


def _plan(model, x, policy, n=2):
    graph = trace(model, {"x": x}, both_modes=False)
    return apply_policy(graph, ComputeConfig(n, n), policy)


def test_tp_that_splits_nothing_warns_why():
    with pytest.warns(PolicyWarning) as record:
        _plan(Odd(), torch.randn(3, 5), "tp")
    msg = str(record[0].message)
    assert "policy 'tp' split no op" in msg and "plan_ngpus=2" in msg and "Odd" in msg
    assert "divisible by 2" in msg and "torch.logcumsumexp" in msg  # why: odd sizes, an unannotated op
    assert record[0].filename == __file__


def test_data_on_an_odd_batch_warns_why():
    with pytest.warns(PolicyWarning, match=r"policy 'data' split no op .*size 3 when traced\) is not divisible "
                                           r"by plan_ngpus=2.*multiple of 2"):
        _plan(Even(), torch.randn(3, 4), "data")


@pytest.mark.parametrize("policy", ["tp", "data"])
def test_policies_that_split_something_are_quiet(policy):
    with warnings.catch_warnings():
        warnings.simplefilter("error", PolicyWarning)
        graph = _plan(Even(), torch.randn(4, 4), policy)
    assert any(p.dim for node in graph.nodes for p in node.pieces)


def test_one_device_is_quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("error", PolicyWarning)
        _plan(Odd(), torch.randn(3, 5), "tp", n=1)


# -- user policies -----------------------------------------------------------------------------------
def policy_that_raises(graph, cfg):
    table = {}
    return table["linear"]  # the user's bug


def policy_that_returns_a_list(graph, cfg):
    from nnscaler.policies import assign, replicate
    return [assign(replicate(graph, node, 1)[0], 0) for node in graph.nodes]


def policy_with_a_bad_partition(graph, cfg):
    from nnscaler.policies import partition, select
    partition(graph, select(graph, op="linear")[0], "nope", 1)  # no such dim
    return graph


def _parallelize(policy, tmp_path):
    from nnscaler import parallelize
    return parallelize(Even(), {"x": torch.randn(4, 4)}, policy, ComputeConfig(1, 1, trace_strategy="cpu"),
                       gen_savedir=tmp_path, load_module=False)


def test_user_policy_that_raises_shows_the_users_frame_first(tmp_path):
    from nnscaler.policies import PlanError
    with pytest.raises(PlanError) as info:
        _parallelize(policy_that_raises, tmp_path)
    msg = str(info.value)
    assert msg.startswith("policy 'bad_inputs.test_policies.policy_that_raises' raised KeyError: 'linear'")
    frames = msg.split("Traceback of the policy (most recent call last):\n")[1]
    assert frames.lstrip().startswith(f'File "{__file__}"') and 'return table["linear"]' in frames
    assert "nnscaler" not in frames.replace(__file__, "")  # no internal frame before or after
    tb = info.value.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    assert tb.tb_frame.f_code.co_name == "parallelize"  # one message: the traceback is cut at parallelize()


def test_user_policy_returning_the_wrong_object_is_told_what_to_return(tmp_path):
    from nnscaler.policies import PlanError
    with pytest.raises(PlanError, match=r"returned list .*a policy must return the graph it was given"):
        _parallelize(policy_that_returns_a_list, tmp_path)


def test_primitive_error_in_a_user_policy_names_the_policy_line(tmp_path):
    from nnscaler.policies import PlanError
    with pytest.raises(PlanError, match=r"cannot partition op .*linear.*'nope'.*called from your policy at "
                                        r".*test_policies.py:\d+: partition\(graph"):
        _parallelize(policy_with_a_bad_partition, tmp_path)


def test_internal_error_in_a_builtin_policy_keeps_its_traceback():
    from nnscaler.policies.user_policy import call_policy

    def boom(graph, cfg):
        raise RuntimeError("internal")
    boom.__code__ = boom.__code__.replace(co_filename=torch.__file__)  # as if it were library code
    with pytest.raises(RuntimeError, match="^internal$") as info:
        call_policy(boom, None, None, "boom")
    assert info.value.__traceback__ is not None and info.value.__cause__ is None


# -- pas_config keys the policy does not read (issue 26: {'sed': 3} was accepted silently) ----------------
@pytest.mark.parametrize("policy, pas, unknown, hint, known", [
    ("tp", {"sed": 3}, "'sed'", "Did you mean 'seed' for 'sed'?", "recompute_modules, seed"),
    ("dp", {"seed": 3}, "'seed'", None, "recompute_modules"),
    ("data", {"colum": ["fc"]}, "'colum'", None, "recompute_modules"),
    ("megatron", {"colum": ["fc"], "rows": ["x"]}, "'colum', 'rows'",
     "Did you mean 'column' for 'colum', 'row' for 'rows'?", "column, heads, recompute_modules, row"),
    ("autodist", {"mem_constriant": 8}, "'mem_constriant'", "Did you mean 'mem_constraint' for 'mem_constriant'?",
     "mem_constraint"),
])
def test_unknown_pas_config_keys_are_refused_with_the_known_ones(policy, pas, unknown, hint, known):
    from nnscaler.ir import ConfigError
    graph = trace(Even(), {"x": torch.randn(4, 4)}, both_modes=False)
    with pytest.raises(ConfigError) as info:
        apply_policy(graph, ComputeConfig(2, 2, pas_config=pas), policy)
    msg = str(info.value)
    assert msg.startswith(f"pas_policy '{policy}' does not know pas_config key(s) {unknown}")
    assert (hint in msg) if hint else "Did you mean" not in msg
    assert known in msg and "prefix your own keys with '_'" in msg


def test_known_common_and_private_keys_are_accepted():
    graph = trace(Even(), {"x": torch.randn(4, 4)}, both_modes=False)
    apply_policy(graph, ComputeConfig(2, 2, pas_config={"seed": 2, "_note": "mine"}), "tp")
    apply_policy(graph, ComputeConfig(1, 1, pas_config={"recompute_modules": "Linear"}), "dp")
    apply_policy(graph, ComputeConfig(1, 1, pas_config={"anything": 1}), lambda g, cfg: _plan_dp(g, cfg))


def _plan_dp(graph, cfg):
    from nnscaler.policies import get_policy
    return get_policy("dp")(graph, cfg)


def test_parallelize_refuses_a_typo_before_writing_code(tmp_path):
    from nnscaler import parallelize
    from nnscaler.ir import ConfigError
    with pytest.raises(ConfigError, match=r"^pas_policy 'tp' does not know pas_config key\(s\) 'sed'"):
        parallelize(Even(), {"x": torch.randn(4, 4)}, "tp", ComputeConfig(1, 1, pas_config={"sed": 3},
                                                                           trace_strategy="cpu"),
                    gen_savedir=tmp_path)
    assert not any(p.name.startswith("gencode") for p in tmp_path.rglob("*"))
