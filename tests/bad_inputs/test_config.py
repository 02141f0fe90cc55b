"""ComputeConfig settings that are valid but do nothing: each warns, naming the key and the fix (or, for
zero_ngroups without use_zero, is refused)."""
from __future__ import annotations

import warnings

import pytest
import torch

from nnscaler import ComputeConfig, parallelize
from nnscaler.ir import ConfigWarning
from nnscaler.ir.config_checks import ineffective_settings

from .models import Small


@pytest.mark.parametrize("kwargs, key, fix", [
    (dict(plan_ngpus=1, runtime_ngpus=4, zero_use_reduce_scatter=True),
     "zero_use_reduce_scatter=True has no effect without use_zero=True", "set use_zero=True"),
    (dict(plan_ngpus=2, runtime_ngpus=2, use_zero=True), "use_zero=True shards nothing",
     "runtime_ngpus=4"),
    (dict(plan_ngpus=1, runtime_ngpus=4, use_zero=True, zero_ngroups=4), "use_zero=True shards nothing",
     "smaller zero_ngroups"),
    (dict(plan_ngpus=2, runtime_ngpus=2, use_zero=3), "use_zero=3 shards nothing: ZeRO shards the parameters, "
     "gradients and optimizer state", "runtime_ngpus=4"),
])
def test_setting_that_does_nothing_is_named(kwargs, key, fix):
    [message] = ineffective_settings(ComputeConfig(**kwargs))
    assert f"ComputeConfig.{key}" in message and fix in message


@pytest.mark.parametrize("kwargs", [
    dict(plan_ngpus=1, runtime_ngpus=4),
    dict(plan_ngpus=1, runtime_ngpus=4, use_zero=True),
    dict(plan_ngpus=1, runtime_ngpus=4, use_zero=True, zero_ngroups=2, zero_use_reduce_scatter=True),
    dict(plan_ngpus=2, runtime_ngpus=4, use_zero=True),
])
def test_effective_settings_are_quiet(kwargs):
    assert ineffective_settings(ComputeConfig(**kwargs)) == []


def test_zero_ngroups_without_use_zero_is_refused():
    """Issue 26: it was accepted (a warning at parallelize only); nothing was sharded."""
    from nnscaler.ir import ConfigError
    with pytest.raises(ConfigError, match=r"^ComputeConfig.zero_ngroups=2 needs use_zero=True.*Set use_zero=True "
                                          r"to shard the optimizer state, or leave zero_ngroups at 1"):
        ComputeConfig(1, 4, zero_ngroups=2)
    assert ComputeConfig(1, 4, use_zero=True, zero_ngroups=2).zero_ngroups == 2


def test_parallelize_warns_at_the_users_call(tmp_path):
    cfg = ComputeConfig(1, 1, use_zero=True, trace_strategy="cpu")
    with pytest.warns(ConfigWarning, match=r"ComputeConfig.use_zero=True shards nothing") as record:
        parallelize(Small(), {"x": torch.randn(2, 4)}, "dp", cfg, gen_savedir=tmp_path)
    assert [w.filename for w in record if issubclass(w.category, ConfigWarning)] == [__file__]


def test_parallelize_with_a_useful_config_does_not_warn(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        parallelize(Small(), {"x": torch.randn(2, 4)}, "dp", ComputeConfig(1, 1, trace_strategy="cpu"),
                    gen_savedir=tmp_path)
