"""autodist's plans and profile cache: save_plan_path writes JSON, load_plan_path applies the same
choices without searching, a stale / mismatched / damaged plan is refused with StalePlanError
naming the reason, verbose prints the plan table; the op profile cache is reused and re_profile
measures again (nnscaler.policies.autodist)."""
from __future__ import annotations

import json

import pytest
import torch

import gpt
from nnscaler.ir import ComputeConfig, ConfigError, trace
from nnscaler.policies import apply_policy
from nnscaler.policies.autodist import StalePlanError, format_plan, read_plan
from nnscaler.policies.autodist.op_keys import op_keys
from nnscaler.policies.autodist.op_profile import device_key

COMM = {"backend": "given", "collectives": {c: {"2": [1e-5, 5e9], "4": [2e-5, 5e9]}
                                            for c in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")}}


def gpt_graph(n_layer=2, **kw):
    cfg = gpt.GPTConfig(n_layer=n_layer, **kw)
    torch.manual_seed(0)
    return trace(gpt.GPT(cfg), gpt.random_batch(0, 4, cfg))


def autodist(graph, plan_ngpus=2, **pas):
    cc = ComputeConfig(plan_ngpus, plan_ngpus, pas_config={"_comm_profile": COMM, "_profile_repeats": 1, **pas})
    return apply_policy(graph, cc, "autodist")


def pieces(graph):
    keys = op_keys(graph)
    return {keys[n.id]: [p.to_dict() for p in n.pieces] for n in graph.nodes}


@pytest.fixture
def saved(tmp_path):
    """A plan searched for the 2-layer GPT on 2 devices and saved; (path, planned graph)."""
    path = tmp_path / "plans" / "gpt.json"  # the directory does not exist yet
    graph = autodist(gpt_graph(), save_plan_path=str(path))
    return path, graph


# -- save / load ----------------------------------------------------------------------------------
def test_save_plan_path_writes_json(saved):
    path, graph = saved
    data = json.loads(path.read_text())
    assert data["format"] == "nnscaler-autodist-plan" and data["version"] == 1
    assert data["module_class"] == "gpt.GPT" and data["plan_ngpus"] == 2 and data["pipeline"] is None
    assert len(data["ops"]) == len(graph.nodes)
    assert {o["key"]: o["choice"] for o in data["ops"]} == {o.key: o.choice for o in graph.autodist_plan.ops}
    assert data["estimate"]["time_s"] == pytest.approx(graph.autodist_plan.estimate["time_s"])
    assert read_plan(path).to_json() == graph.autodist_plan.to_json()


def test_load_plan_path_applies_the_same_choices(saved):
    path, planned = saved
    graph = autodist(gpt_graph(), load_plan_path=str(path))
    assert pieces(graph) == pieces(planned)
    assert any(p["dim"] for ps in pieces(graph).values() for p in ps)  # the plan splits something
    # nothing was searched: the record (its search time included) is the file's
    assert graph.autodist_plan.to_json() == json.loads(path.read_text())


def test_plan_for_other_shapes_is_refused(saved):
    path, _ = saved
    with pytest.raises(StalePlanError) as err:
        autodist(gpt_graph(n_embd=64), load_plan_path=str(path))
    message = str(err.value)
    assert "does not fit this model" in message and "had input shapes" in message and str(path) in message
    assert "search again" in message


def test_plan_for_other_depth_is_refused(saved):
    path, _ = saved
    with pytest.raises(StalePlanError, match="is not in the plan"):
        autodist(gpt_graph(n_layer=3), load_plan_path=str(path))
    with pytest.raises(StalePlanError, match="the plan has ops the model no longer has: h.1"):
        autodist(gpt_graph(n_layer=1), load_plan_path=str(path))


def test_plan_for_other_plan_ngpus_is_refused(saved):
    path, _ = saved
    with pytest.raises(StalePlanError, match="it was made for plan_ngpus=2, this run has plan_ngpus=4"):
        autodist(gpt_graph(), plan_ngpus=4, load_plan_path=str(path))


def test_plan_for_other_model_class_is_refused(saved, tmp_path):
    path, _ = saved
    data = json.loads(path.read_text())
    data["module_class"] = "other.Model"
    other = tmp_path / "other.json"
    other.write_text(json.dumps(data))
    with pytest.raises(StalePlanError, match="it was made for other.Model, this model is gpt.GPT"):
        autodist(gpt_graph(), load_plan_path=str(other))


def test_plan_with_impossible_choice_is_refused(saved, tmp_path):
    path, _ = saved
    data = json.loads(path.read_text())
    op = next(o for o in data["ops"] if o["key"] == "h.0.mlp.c_fc|linear|0")
    op["choice"] = "no_such_dim"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(StalePlanError, match=r"op h.0.mlp.c_fc\|linear\|0 cannot be split along 'no_such_dim' on 2 devices"):
        autodist(gpt_graph(), load_plan_path=str(bad))


@pytest.mark.parametrize("damage,expected", [
    (lambda text, data: text[: len(text) // 2], "is not valid JSON"),
    (lambda text, data: "[1, 2]", "is not an autodist plan"),
    (lambda text, data: json.dumps(dict(data, format="something-else")), "is not an autodist plan"),
    (lambda text, data: json.dumps(dict(data, version=99)), "plan format version 99"),
    (lambda text, data: json.dumps({k: v for k, v in data.items() if k != "ops"}), "is a damaged autodist plan"),
    (lambda text, data: json.dumps(dict(data, ops=[{"key": "x"}])), "is a damaged autodist plan"),
    (lambda text, data: json.dumps(dict(data, plan_ngpus="two")), "is a damaged autodist plan"),
    (lambda text, data: json.dumps(dict(data, pipeline={"nstages": 2})), "'pipeline' must be null or a mapping"),
    (lambda text, data: json.dumps(dict(data, pipeline=[2, 1])), "'pipeline' must be null or a mapping"),
])
def test_damaged_plan_is_refused(saved, tmp_path, damage, expected):
    path, _ = saved
    text = path.read_text()
    bad = tmp_path / "damaged.json"
    bad.write_text(damage(text, json.loads(text)))
    with pytest.raises(StalePlanError) as err:
        autodist(gpt_graph(), load_plan_path=str(bad))
    assert expected in str(err.value) and str(bad) in str(err.value), str(err.value)
    assert isinstance(err.value, ConfigError)


def test_missing_plan_is_refused_by_the_config(tmp_path):
    with pytest.raises(ConfigError, match="'load_plan_path'.*no such file"):
        autodist(gpt_graph(), load_plan_path=str(tmp_path / "none.json"))


def test_verbose_prints_the_plan_table(capsys):
    graph = autodist(gpt_graph(), verbose=True)
    out = capsys.readouterr().out
    assert out.strip() == format_plan(graph.autodist_plan).strip()
    lines = out.splitlines()
    assert lines[0].startswith("autodist plan for gpt.GPT on plan_ngpus=2")
    assert lines[1].split() == ["module", "partition", "(op:choice)", "memory", "MB", "time", "ms", "stage"]
    modules = [line.split()[0] for line in lines[3:-2]]
    assert modules[:3] == ["(root)", "wte", "wpe"] and "h.0.attn" in modules and "h.1.mlp" in modules
    assert lines[-1].startswith("total: estimated step time")
    assert f"{graph.autodist_plan.estimate['time_s'] * 1e3:.3f} ms" in lines[-1]


def test_not_verbose_prints_nothing(capsys):
    autodist(gpt_graph())
    assert "autodist plan" not in capsys.readouterr().out


# -- the profile cache ----------------------------------------------------------------------------
def test_profile_cache_is_reused_and_re_profile_measures_again(tmp_path, monkeypatch):
    monkeypatch.setenv("NNSCALER_CACHE_DIR", str(tmp_path / "cache"))
    first = autodist(gpt_graph()).autodist_plan.estimate
    db = tmp_path / "cache" / "autodist" / f"profile-{device_key('cpu')}.json"
    assert db.is_file()
    entries = json.loads(db.read_text())["ops"]
    ops = [k for k in entries if not k.startswith("__")]  # and the optimizer's costs, the graph's calibration
    assert first["profiled_ops"] == len(ops) > 0
    assert any(k.startswith("__graph__:") for k in entries) and first["compute_calibration"] > 0
    assert first["cached_ops"] > 0  # the second layer repeats the first one's ops
    second = autodist(gpt_graph()).autodist_plan.estimate
    assert second["profiled_ops"] == 0
    assert second["cached_ops"] == first["profiled_ops"] + first["cached_ops"]
    again = autodist(gpt_graph(), re_profile=True).autodist_plan.estimate
    # every distinct op measured again, once: its copies reuse the new measurement
    assert again["profiled_ops"] == first["profiled_ops"] and again["cached_ops"] == first["cached_ops"]
    assert set(json.loads(db.read_text())["ops"]) == set(entries)
    # a deeper model of the same layer shapes reuses every entry
    deeper = autodist(gpt_graph(n_layer=4)).autodist_plan.estimate
    assert deeper["profiled_ops"] == 0 and deeper["cached_ops"] > second["cached_ops"]
    assert set(json.loads(db.read_text())["ops"]) == set(entries)  # nor the graph's or the optimizer's
    assert deeper["compute_calibration"] == again["compute_calibration"]  # the factor measured last (re_profile)


def test_damaged_profile_cache_is_measured_again(tmp_path, monkeypatch):
    monkeypatch.setenv("NNSCALER_CACHE_DIR", str(tmp_path / "cache"))
    db = tmp_path / "cache" / "autodist" / f"profile-{device_key('cpu')}.json"
    db.parent.mkdir(parents=True)
    db.write_text("{not json")
    est = autodist(gpt_graph()).autodist_plan.estimate
    assert est["profiled_ops"] > 0
    assert json.loads(db.read_text())["ops"]


def test_loaded_plan_must_obey_the_constraints(tmp_path):
    """A saved plan that splits attention projections is refused when the constraints forbid it."""
    import gpt
    from nnscaler.ir import ComputeConfig, trace
    from nnscaler.policies import apply_policy
    from nnscaler.policies.autodist import StalePlanError
    from nnscaler.policies.autodist.plan_file import read_plan, save_plan
    cfg = gpt.GPTConfig(n_layer=1, n_embd=32, n_head=2, block_size=16, vocab_size=64)
    comm = {"backend": "given", "collectives": {c: {"2": [1e-5, 5e9]} for c in
                                                ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")}}
    plan = tmp_path / "plan.json"
    graph = apply_policy(trace(gpt.GPT(cfg), gpt.random_batch(0, 4, cfg)),
                         ComputeConfig(2, 2, pas_config={"_comm_profile": comm, "save_plan_path": str(plan)}), "autodist")
    record = read_plan(plan)
    for op in record.ops:  # force a split of q_proj into the saved plan
        if op.key == "h.0.attn.q_proj|linear|0":
            op.choice = "n"
    save_plan(record, plan)
    rules = tmp_path / "rules.yaml"
    rules.write_text("- module: 'h.*.attn.q_proj'\n  replicate: true\n")
    with pytest.raises(StalePlanError, match=r"breaks the partition constraints .*h.0.attn.q_proj\|linear\|0 is 'n', allowed \['R'\]"):
        apply_policy(trace(gpt.GPT(cfg), gpt.random_batch(0, 4, cfg)),
                     ComputeConfig(2, 2, pas_config={"_comm_profile": comm, "load_plan_path": str(plan),
                                                     "partition_constraints_path": str(rules)}), "autodist")
    assert graph.autodist_plan.ops
