"""autodist's `pas_config`: every key of the seed accepted with a good value, every bad key or value
refused with a ConfigError that names the key (nnscaler.policies.autodist.config)."""
from __future__ import annotations

import importlib.util
import re

import pytest
import torch
import torch.nn as nn

from nnscaler.ir import ComputeConfig, ConfigError, trace
from nnscaler.policies import apply_policy
from nnscaler.policies.autodist import AutodistConfig, AutodistWarning
from nnscaler.policies.autodist.config import KEYS

COMM = {"backend": "given", "collectives": {c: {"2": [1e-5, 5e9], "4": [2e-5, 5e9]}
                                            for c in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")}}


def config(pas, plan_ngpus=2, runtime_ngpus=None, **compute):
    cc = ComputeConfig(plan_ngpus, runtime_ngpus or plan_ngpus, pas_config=pas, **compute)
    return AutodistConfig.from_compute_config(cc)


@pytest.fixture
def files(tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text("{}")  # existence is all the config checks; load_plan checks the content
    rules = tmp_path / "rules.yaml"
    rules.write_text("- module: Block\n  replicate: true\n")
    return {"plan": str(plan), "rules": str(rules), "out": str(tmp_path / "out" / "saved.json")}


# key -> (pas_config, ComputeConfig kwargs, expected attributes of AutodistConfig)
GOOD = {
    "update_freq": ({"update_freq": 4}, {}, {"update_freq": 4, "nmicros": 4}),
    "mem_constraint": ({"mem_constraint": 8}, {}, {"mem_constraint": 8.0, "mem_limit_bytes": 8 * 1024 ** 3}),
    "task_name": ({"task_name": "gpt-small"}, {}, {"task_name": "gpt-small"}),
    "use_fp16": ({"use_fp16": True}, {}, {"use_fp16": True}),
    "use_memory_efficient_fp16": ({"use_fp16": True, "use_memory_efficient_fp16": True}, {},
                                  {"use_memory_efficient_fp16": True}),
    "use_bf16": ({"use_bf16": True}, {}, {"use_bf16": True}),
    "use_memory_efficient_bf16": ({"use_bf16": True, "use_memory_efficient_bf16": True}, {},
                                  {"use_memory_efficient_bf16": True}),
    "re_profile": ({"re_profile": True}, {}, {"re_profile": True}),
    "verbose": ({"verbose": True}, {}, {"verbose": True}),
    "load_plan_path": ({"load_plan_path": "{plan}"}, {}, {"load_plan_path": "{plan}"}),
    "save_plan_path": ({"save_plan_path": "{out}"}, {}, {"save_plan_path": "{out}"}),
    "partition_constraints_path": ({"partition_constraints_path": "{rules}"}, {},
                                   {"partition_constraints_path": "{rules}"}),
    "recompute_modules": ({"recompute_modules": "Block, h.0.attn"}, {}, {"recompute_modules": ["Block", "h.0.attn"]}),
    "pipeline_pivots": ({"pipeline_pivots": ["Block"]}, {"use_end2end": True},
                        {"pipeline_pivots": ["Block"], "pipeline_nstages": "auto"}),
    "pipeline_nstages": ({"pipeline_nstages": 2, "pipeline_pivots": "Block"}, {"use_end2end": True, "plan_ngpus": 4},
                         {"pipeline_nstages": 2, "pipeline_pivots": ["Block"]}),
    "pipeline_nmicros": ({"update_freq": 2, "pipeline_nmicros": 8}, {}, {"pipeline_nmicros": 8, "nmicros": 8}),
    "pipeline_scheduler": ({"pipeline_scheduler": "1f1b"}, {}, {"pipeline_scheduler": "1f1b"}),
    "use_apex_fused_adam_v2": ({"use_apex_fused_adam_v2": True}, {}, {"use_apex_fused_adam_v2": True}),
    "parallel_profile": ({"parallel_profile": False}, {}, {"parallel_profile": False}),
    "max_partition_degree": ({"max_partition_degree": 2}, {"plan_ngpus": 4}, {"max_partition_degree": 2}),
    "transient_mem_coef": ({"transient_mem_coef": 0}, {}, {"transient_mem_coef": 0.0}),
    "zero3_units": ({"zero3_units": ["h.0", "h.1"]}, {"use_zero": 3, "runtime_ngpus": 4},
                    {"zero3_units": ["h.0", "h.1"], "zero_stage": 3}),
    "zero3_reshard_after_forward": ({"zero3_reshard_after_forward": {"h.*": False}}, {"use_zero": 3, "runtime_ngpus": 4},
                                    {"zero3_reshard_after_forward": {"h.*": False}}),
    "zero3_mixed_precision": ({"zero3_mixed_precision": {"param_dtype": "bf16"}}, {"use_zero": 3, "runtime_ngpus": 4},
                              {"zero3_mixed_precision": {"param_dtype": "bf16"}}),
}


def _fill(obj, files):
    if isinstance(obj, str):
        return obj.format(**files)
    if isinstance(obj, dict):
        return {k: _fill(v, files) for k, v in obj.items()}
    return obj


def test_every_seed_key_has_a_good_case():
    assert set(GOOD) == set(KEYS)


@pytest.mark.parametrize("key", sorted(GOOD))
def test_good_value_accepted(key, files):
    pas, compute, expected = (_fill(x, files) for x in GOOD[key])
    compute = dict(compute)
    plan_ngpus = compute.pop("plan_ngpus", 2)
    cfg = config(pas, plan_ngpus, **compute)
    for attr, value in expected.items():
        assert getattr(cfg, attr) == value, attr


def test_defaults():
    cfg = config({})
    assert (cfg.update_freq, cfg.mem_constraint, cfg.pipeline_nstages, cfg.pipeline_scheduler) == (1, None, "auto", "1f1b")
    assert cfg.max_partition_degree is None and cfg.transient_mem_coef == 2.0 and cfg.parallel_profile is True
    assert cfg.recompute_modules == [] and cfg.pipeline_pivots == [] and cfg.mem_limit_bytes is None
    assert config({}, 2, runtime_ngpus=8).dp_size == 4


def test_private_keys():
    cfg = config({"_comm_profile": COMM, "_solver_time_limit": 2.5, "_profile_repeats": 1, "_optimizer_states": 0,
                  "_my_own_key": {"anything": [1, "x"]}})
    assert cfg.comm_profile == COMM
    assert (cfg.solver_time_limit, cfg.profile_repeats, cfg.optimizer_states) == (2.5, 1, 0)


BOOLS = ["use_fp16", "use_memory_efficient_fp16", "use_bf16", "use_memory_efficient_bf16", "re_profile", "verbose",
         "use_apex_fused_adam_v2", "parallel_profile"]

# (pas_config, ComputeConfig kwargs, the key the message must name, more text the message must hold)
BAD = [
    ({"mem_constriant": 8}, {}, "mem_constriant", "does not know"),
    ({"update_frequency": 2, "verbos": True}, {}, "update_frequency", "verbos"),
    *[({key: value}, {}, key, "true or false") for key in BOOLS for value in (1, "yes")],
    ({"update_freq": 0}, {}, "update_freq", ">= 1"),
    ({"update_freq": "2"}, {}, "update_freq", "integer"),
    ({"update_freq": True}, {}, "update_freq", "integer"),
    ({"update_freq": 2.0}, {}, "update_freq", "integer"),
    ({"mem_constraint": 0}, {}, "mem_constraint", "> 0"),
    ({"mem_constraint": -4}, {}, "mem_constraint", "> 0"),
    ({"mem_constraint": "8GB"}, {}, "mem_constraint", "number"),
    ({"mem_constraint": True}, {}, "mem_constraint", "number"),
    ({"task_name": ""}, {}, "task_name", "string"),
    ({"task_name": 3}, {}, "task_name", "string"),
    ({"load_plan_path": "{missing}"}, {}, "load_plan_path", "no such file"),
    ({"load_plan_path": 42}, {}, "load_plan_path", "file path"),
    ({"save_plan_path": ""}, {}, "save_plan_path", "file path"),
    ({"save_plan_path": ["a.json"]}, {}, "save_plan_path", "file path"),
    ({"partition_constraints_path": "{missing}"}, {}, "partition_constraints_path", "no such file"),
    ({"recompute_modules": 3}, {}, "recompute_modules", "module names"),
    ({"recompute_modules": ["Block", 1]}, {}, "recompute_modules", "module names"),
    ({"pipeline_pivots": {"Block": 1}}, {"use_end2end": True}, "pipeline_pivots", "module names"),
    ({"pipeline_pivots": "Block"}, {}, "pipeline_pivots", "use_end2end=True"),
    ({"pipeline_nstages": 0}, {}, "pipeline_nstages", ">= 1"),
    ({"pipeline_nstages": "two"}, {}, "pipeline_nstages", "integer"),
    ({"pipeline_nstages": 1, "pipeline_pivots": "Block"}, {"use_end2end": True}, "pipeline_nstages",
     "pipeline_pivots must not be set"),
    ({"pipeline_nstages": 2}, {}, "pipeline_nstages", "needs pipeline_pivots"),
    ({"pipeline_nstages": 3, "pipeline_pivots": "Block"}, {"use_end2end": True, "plan_ngpus": 4}, "pipeline_nstages",
     "must divide plan_ngpus"),
    ({"pipeline_nmicros": 0}, {}, "pipeline_nmicros", ">= 1"),
    ({"pipeline_scheduler": "gpipe"}, {}, "pipeline_scheduler", "'1f1b'"),
    ({"pipeline_scheduler": "interleaved_1f1b"}, {}, "pipeline_scheduler", "'1f1b'"),
    ({"max_partition_degree": 4}, {}, "max_partition_degree", "more than plan_ngpus"),
    ({"max_partition_degree": 0}, {}, "max_partition_degree", ">= 1"),
    ({"transient_mem_coef": -1}, {}, "transient_mem_coef", ">= 0"),
    ({"transient_mem_coef": "2"}, {}, "transient_mem_coef", "number"),
    ({"_solver_time_limit": 0}, {}, "_solver_time_limit", "> 0"),
    ({"_profile_repeats": 0}, {}, "_profile_repeats", ">= 1"),
    ({"_optimizer_states": -1}, {}, "_optimizer_states", ">= 0"),
    ({"zero3_units": ["h.0", 3]}, {}, "zero3_units", "module classes, path globs or module paths"),
    ({"zero3_units": " , "}, {}, "zero3_units", "module classes, path globs or module paths"),
    ({"zero3_reshard_after_forward": "yes"}, {}, "zero3_reshard_after_forward", "not a string"),
    ({"zero3_mixed_precision": {"param_dtype": "int8"}}, {}, "zero3_mixed_precision", "give a floating dtype by name"),
    ({"zero3_reshard_after_forward": 3}, {"use_zero": 3, "runtime_ngpus": 4, "plan_ngpus": 1},
     "zero3_reshard_after_forward", "does not divide the zero group size 4"),
]


@pytest.mark.parametrize("pas,compute,key,text", BAD, ids=[f"{i}-{case[2]}" for i, case in enumerate(BAD)])
def test_bad_value_refused(pas, compute, key, text, tmp_path):
    pas = _fill(pas, {"missing": str(tmp_path / "missing.json")})
    compute = dict(compute)
    plan_ngpus = compute.pop("plan_ngpus", 2)
    with pytest.raises(ConfigError) as err:
        config(pas, plan_ngpus, **compute)
    message = str(err.value)
    assert f"'{key}'" in message or f"{key} " in message, message
    assert text in message, message


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x))).sum()


def _tiny_graph():
    torch.manual_seed(0)
    return trace(_Tiny(), {"x": torch.randn(4, 8)})


def test_policy_refuses_an_unknown_key():
    with pytest.raises(ConfigError, match=re.escape("'mem_limit'")):
        apply_policy(_tiny_graph(), ComputeConfig(2, 2, pas_config={"mem_limit": 1, "_comm_profile": COMM}),
                     "autodist")


def test_apex_absent_warns(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: None if name == "apex" else real(name, *a, **k))
    cc = ComputeConfig(2, 2, pas_config={"use_apex_fused_adam_v2": True, "_comm_profile": COMM, "_profile_repeats": 1})
    with pytest.warns(AutodistWarning, match="use_apex_fused_adam_v2 is set but apex is not installed"):
        graph = apply_policy(_tiny_graph(), cc, "autodist")
    assert all(node.pieces for node in graph.nodes)  # the plan is made all the same


def test_apex_present_does_not_warn(monkeypatch, recwarn):
    real = importlib.util.find_spec
    sentinel = object()
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: sentinel if name == "apex" else real(name, *a, **k))
    cc = ComputeConfig(2, 2, pas_config={"use_apex_fused_adam_v2": True, "_comm_profile": COMM, "_profile_repeats": 1})
    apply_policy(_tiny_graph(), cc, "autodist")
    assert not [w for w in recwarn if issubclass(w.category, AutodistWarning)]
