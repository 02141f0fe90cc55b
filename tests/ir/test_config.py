"""ComputeConfig: the documented defaults, validation with helpful messages, (de)serialisation,
differences and OptionalComputeConfig.resolve."""
import dataclasses
import json

import pytest

from nnscaler.ir import ComputeConfig, ConfigError, OptionalComputeConfig
from nnscaler.ir.config import DEFAULT_BUCKET_CAP_MB, TRACE_STRATEGIES


def test_seed_defaults():
    c = ComputeConfig(plan_ngpus=2, runtime_ngpus=8)
    assert c.plan_ngpus == 2 and c.runtime_ngpus == 8
    assert c.constant_folding is False
    assert c.trace_strategy == "cuda_run_cpu_offload"
    assert c.use_zero is False
    assert c.zero_ngroups == 1
    assert c.inference_only is False
    assert c.use_end2end is False
    assert c.pas_config == {} and c.user_config == {}
    assert c.use_async_reducer is False
    assert c.reducer_bucket_cap_mb is None
    assert c.bucket_cap_mb == DEFAULT_BUCKET_CAP_MB == 25.0
    assert c.zero_use_reduce_scatter is False
    assert c.sync_batchnorm is False  # per-replica batch statistics, as DDP
    assert c.dp_size == 4


def test_field_order_and_required_fields():
    names = [f.name for f in dataclasses.fields(ComputeConfig)]
    assert names[:2] == ["plan_ngpus", "runtime_ngpus"]
    assert set(names) == {"plan_ngpus", "runtime_ngpus", "constant_folding", "trace_strategy", "use_zero",
                          "zero_ngroups", "zero_use_reduce_scatter", "use_async_reducer",
                          "reducer_bucket_cap_mb", "inference_only", "use_end2end", "pas_config", "user_config",
                          "rng_mode", "sync_batchnorm"}
    assert ComputeConfig(1, 2).runtime_ngpus == 2  # positional, as in the seed
    with pytest.raises(TypeError):
        ComputeConfig(plan_ngpus=1)
    assert set(TRACE_STRATEGIES) == {"cpu", "cuda", "meta", "cuda_run_cpu_offload", "reuse_cache"}


def test_dict_defaults_are_not_shared():
    a, b = ComputeConfig(1, 1), ComputeConfig(1, 1)
    assert a.pas_config is not b.pas_config and a.user_config is not b.user_config


def test_frozen():
    c = ComputeConfig(1, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.plan_ngpus = 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.use_zero = True


@pytest.mark.parametrize("kwargs,words", [
    (dict(plan_ngpus=0, runtime_ngpus=4), ["plan_ngpus", "positive integer", "got 0"]),
    (dict(plan_ngpus=1, runtime_ngpus=-2), ["runtime_ngpus", "positive integer"]),
    (dict(plan_ngpus=1, runtime_ngpus=1, zero_ngroups=0), ["zero_ngroups", "positive integer"]),
    (dict(plan_ngpus=2.0, runtime_ngpus=4), ["plan_ngpus", "must be int", "float"]),
    (dict(plan_ngpus=True, runtime_ngpus=1), ["plan_ngpus", "must be int", "bool"]),
    (dict(plan_ngpus=1, runtime_ngpus="2"), ["runtime_ngpus", "must be int", "str"]),
    (dict(plan_ngpus=2, runtime_ngpus=3), ["runtime_ngpus (3)", "multiple of plan_ngpus (2)", "Use runtime_ngpus=2",
                                           "or change plan_ngpus"]),
    (dict(plan_ngpus=4, runtime_ngpus=6), ["multiple of plan_ngpus (4)", "Use runtime_ngpus=4"]),
    (dict(plan_ngpus=1, runtime_ngpus=1, constant_folding=1), ["constant_folding", "must be bool", "int"]),
    (dict(plan_ngpus=1, runtime_ngpus=1, use_zero="yes"), ["use_zero", "must be False/0", "or 3", "str"]),
    (dict(plan_ngpus=1, runtime_ngpus=1, use_zero=2), ["use_zero", "True/1", "or 3", "got int 2"]),
    (dict(plan_ngpus=1, runtime_ngpus=1, zero_use_reduce_scatter=None), ["zero_use_reduce_scatter", "bool"]),
    (dict(plan_ngpus=1, runtime_ngpus=1, use_async_reducer=0), ["use_async_reducer", "bool"]),
    (dict(plan_ngpus=1, runtime_ngpus=1, inference_only="no"), ["inference_only", "bool"]),
    (dict(plan_ngpus=1, runtime_ngpus=1, use_end2end=1.0), ["use_end2end", "bool"]),
    (dict(plan_ngpus=1, runtime_ngpus=1, sync_batchnorm="yes"), ["sync_batchnorm", "must be bool", "str"]),
    (dict(plan_ngpus=1, runtime_ngpus=1, trace_strategy="gpu"), ["trace_strategy", "one of", "reuse_cache", "'gpu'"]),
    (dict(plan_ngpus=1, runtime_ngpus=1, trace_strategy=None), ["trace_strategy", "must be str"]),
    (dict(plan_ngpus=1, runtime_ngpus=1, reducer_bucket_cap_mb=0), ["reducer_bucket_cap_mb", "> 0"]),
    (dict(plan_ngpus=1, runtime_ngpus=1, reducer_bucket_cap_mb=-1.5), ["reducer_bucket_cap_mb", "> 0"]),
    (dict(plan_ngpus=1, runtime_ngpus=1, reducer_bucket_cap_mb=float("nan")), ["reducer_bucket_cap_mb", "> 0"]),
    (dict(plan_ngpus=1, runtime_ngpus=1, reducer_bucket_cap_mb="25"), ["reducer_bucket_cap_mb", "int or float"]),
    (dict(plan_ngpus=1, runtime_ngpus=1, reducer_bucket_cap_mb=True), ["reducer_bucket_cap_mb", "bool"]),
    (dict(plan_ngpus=2, runtime_ngpus=12, use_zero=True, zero_ngroups=4),
     ["zero_ngroups (4)", "must divide", "runtime_ngpus // plan_ngpus = 6"]),
    (dict(plan_ngpus=1, runtime_ngpus=1, pas_config=[("a", 1)]), ["pas_config", "must be dict", "list"]),
    (dict(plan_ngpus=1, runtime_ngpus=1, user_config="x"), ["user_config", "must be dict"]),
    (dict(plan_ngpus=1, runtime_ngpus=1, pas_config={"f": object()}), ["pas_config", "JSON values", "saved"]),
    (dict(plan_ngpus=1, runtime_ngpus=1, user_config={1: "a"}), ["user_config", "JSON", "str keys"]),
    (dict(plan_ngpus=1, runtime_ngpus=1, user_config={"mesh": (2, 2)}), ["user_config", "JSON", "round trip"]),
    (dict(plan_ngpus=1, runtime_ngpus=1, pas_config={"lr": float("nan")}), ["pas_config", "JSON"]),
    (dict(plan_ngpus=1, runtime_ngpus=1, pas_config={"a": {"b": {1, 2}}}), ["pas_config", "JSON"]),
])
def test_validation_errors_name_field_and_fix(kwargs, words):
    with pytest.raises(ConfigError) as e:
        ComputeConfig(**kwargs)
    for w in words:
        assert w in str(e.value), (w, str(e.value))
    assert isinstance(e.value, ValueError)


@pytest.mark.parametrize("kwargs", [
    dict(plan_ngpus=3, runtime_ngpus=12),
    dict(plan_ngpus=1, runtime_ngpus=6, use_zero=True, zero_ngroups=3),
    dict(plan_ngpus=1, runtime_ngpus=1, reducer_bucket_cap_mb=1),
    dict(plan_ngpus=1, runtime_ngpus=1, reducer_bucket_cap_mb=0.5),
    dict(plan_ngpus=1, runtime_ngpus=1, pas_config=None, user_config=None),
    dict(plan_ngpus=1, runtime_ngpus=1, pas_config={"a": [1, {"b": None}], "c": 1.5, "d": True}),
    *[dict(plan_ngpus=1, runtime_ngpus=1, trace_strategy=s) for s in TRACE_STRATEGIES],
])
def test_valid_configs(kwargs):
    c = ComputeConfig(**kwargs)
    for k, v in kwargs.items():
        assert getattr(c, k) == (v if v is not None else {})
    assert ComputeConfig.from_dict(json.loads(json.dumps(c.to_dict()))) == c


def test_bucket_cap_and_dp_size():
    assert ComputeConfig(1, 1, reducer_bucket_cap_mb=4).bucket_cap_mb == 4.0
    assert isinstance(ComputeConfig(1, 1, reducer_bucket_cap_mb=4).bucket_cap_mb, float)
    assert ComputeConfig(4, 4).dp_size == 1
    assert ComputeConfig(2, 16).dp_size == 8


def test_to_dict_from_dict_round_trip():
    c = ComputeConfig(2, 4, constant_folding=True, trace_strategy="meta", use_zero=True, zero_ngroups=2,
                      reducer_bucket_cap_mb=8.0, pas_config={"stages": [1, 2]}, user_config={"seq": 128})
    d = c.to_dict()
    assert d["plan_ngpus"] == 2 and d["pas_config"] == {"stages": [1, 2]} and d["zero_ngroups"] == 2
    assert set(d) == {f.name for f in dataclasses.fields(ComputeConfig)}
    assert ComputeConfig.from_dict(json.loads(json.dumps(d))) == c
    d["pas_config"]["stages"].append(3)  # a copy: the config is untouched
    assert c.pas_config == {"stages": [1, 2]}


def test_from_dict_rejects_unknown_keys_and_validates():
    with pytest.raises(ConfigError) as e:
        ComputeConfig.from_dict({"plan_ngpus": 1, "runtime_ngpus": 1, "zero": True, "ngpus": 2})
    msg = str(e.value)
    assert "ngpus, zero" in msg and "known fields" in msg and "use_zero" in msg
    with pytest.raises(ConfigError, match="runtime_ngpus"):
        ComputeConfig.from_dict({"plan_ngpus": 2, "runtime_ngpus": 3})
    with pytest.raises(TypeError):
        ComputeConfig.from_dict({"plan_ngpus": 2})
    assert ComputeConfig.from_dict({"plan_ngpus": 1, "runtime_ngpus": 2}) == ComputeConfig(1, 2)


def test_differences():
    a = ComputeConfig(1, 2)
    b = ComputeConfig(1, 2, use_zero=True, pas_config={"x": 1})
    assert a.differences(a) == {} and a.differences(ComputeConfig(1, 2)) == {}
    assert a.differences(b) == {"use_zero": (False, True), "pas_config": ({}, {"x": 1})}
    assert b.differences(a) == {"use_zero": (True, False), "pas_config": ({"x": 1}, {})}


def test_graph_key_has_only_graph_shaping_fields():
    a = ComputeConfig(1, 2, user_config={"n": 1})
    assert a.graph_key() == {"constant_folding": False, "user_config": {"n": 1}}
    assert ComputeConfig(2, 4, use_zero=True, user_config={"n": 1}).graph_key() == a.graph_key()
    assert ComputeConfig(1, 2, constant_folding=True, user_config={"n": 1}).graph_key() != a.graph_key()


def test_optional_resolve_overrides_only_given_fields():
    base = ComputeConfig(2, 8, use_async_reducer=True, user_config={"u": 1})
    empty = OptionalComputeConfig()
    assert empty.resolve(base) == base
    r = OptionalComputeConfig(use_zero=True, zero_ngroups=2, pas_config={"p": 1},
                              reducer_bucket_cap_mb=10.0).resolve(base)
    assert (r.use_zero, r.zero_ngroups, r.pas_config, r.reducer_bucket_cap_mb) == (True, 2, {"p": 1}, 10.0)
    assert (r.plan_ngpus, r.runtime_ngpus, r.use_async_reducer, r.user_config) == (2, 8, True, {"u": 1})
    assert base.use_zero is False  # the base is not modified
    off = OptionalComputeConfig(constant_folding=False, use_async_reducer=False).resolve(
        ComputeConfig(1, 1, constant_folding=True, use_async_reducer=True))
    assert off.constant_folding is False and off.use_async_reducer is False  # False is a value, not "unset"
    assert OptionalComputeConfig(trace_strategy="cpu").resolve(base).trace_strategy == "cpu"


def test_optional_resolve_validates():
    with pytest.raises(ConfigError, match="zero_ngroups"):
        OptionalComputeConfig(use_zero=True, zero_ngroups=3).resolve(ComputeConfig(1, 4))
    with pytest.raises(ConfigError, match="trace_strategy"):
        OptionalComputeConfig(trace_strategy="tpu").resolve(ComputeConfig(1, 4))
    names = {f.name for f in dataclasses.fields(OptionalComputeConfig)}
    assert "plan_ngpus" not in names and "runtime_ngpus" not in names
    assert all(f.default is None for f in dataclasses.fields(OptionalComputeConfig))
    with pytest.raises(dataclasses.FrozenInstanceError):
        OptionalComputeConfig().use_zero = True
