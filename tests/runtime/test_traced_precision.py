"""`runtime/driver/traced_precision.py`: under ``pas_config["zero3_mixed_precision"]`` generation
traces the forward with the parameters in their unit's ``param_dtype`` and declares them in the
dtype they are stored in; the module is left as it was; bad settings are refused before anything
is generated (one process, no launch: ``load_module=False`` only generates)."""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from nnscaler import ComputeConfig, parallelize
from nnscaler.ir.contracts import GRAPH_FILE, WEIGHTS_FILE, gencode_file
from nnscaler.ir.errors import ConfigError
from nnscaler.runtime.driver.traced_precision import trace_precision

_MODELS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models")
if _MODELS not in sys.path:
    sys.path.insert(0, _MODELS)

import hf_models  # noqa: E402

BF16 = {"param_dtype": "bfloat16", "reduce_dtype": "float32"}


def _cfg(policy, use_zero=3, **kw):
    return ComputeConfig(1, 2, trace_strategy="cpu", use_zero=use_zero, pas_config={"zero3_mixed_precision": policy},
                         **kw)


def _dummy():
    return {k: v[:2] for k, v in hf_models.batch("llama", 0, 2).items()}


def test_trace_casts_follow_the_units():
    model = hf_models.make("llama", dtype=torch.float32)
    names = [n for n, _ in model.named_parameters()]
    units = ["model.lm_head", "model.model.embed_tokens", "model.model.layers.0", "model.model.layers.1"]
    got = trace_precision(model, _cfg(BF16))
    assert got.params == {n: torch.bfloat16 for n in names}
    assert got.inputs == {u: torch.bfloat16 for u in units}  # the root's (final norm) are not cast
    head = trace_precision(model, _cfg({**BF16, "units": {"model.lm_head": {"param_dtype": "float32"}}}))
    assert head.params == {n: torch.bfloat16 for n in names if n != "model.lm_head.weight"}
    assert head.inputs == {**{u: torch.bfloat16 for u in units}, "model.lm_head": torch.float32}
    same = trace_precision(model, _cfg({"param_dtype": "float32"}))  # already stored so: no parameter cast
    assert same.params == {} and same.inputs == {u: torch.float32 for u in units}
    plain = trace_precision(model, ComputeConfig(1, 2, use_zero=3))
    assert plain.params == plain.inputs == {}


def test_generation_traces_in_param_dtype_and_stores_in_the_modules(tmp_path):
    model = hf_models.make("llama", dtype=torch.float32)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = {n: id(p) for n, p in model.named_parameters()}
    assert parallelize(model, _dummy(), "dp", _cfg(BF16), gen_savedir=tmp_path, load_module=False) is None
    # the module is as it was: the same Parameters, fp32, the same values
    for n, p in model.named_parameters():
        assert id(p) == ids[n] and p.dtype == torch.float32 and torch.equal(p, before[n]), n
    code = next(tmp_path.rglob(gencode_file(0))).read_text()
    registered = [line for line in code.splitlines() if "register_parameter(" in line]
    assert len(registered) == len(before) and all("dtype=torch.float32" in line for line in registered)
    graph = json.loads(next(tmp_path.rglob(GRAPH_FILE)).read_text())
    values = {v[0]: v[4] for v in graph["values"]}
    assert {s["dtype"] for s in graph["params"]} == {"float32"}  # stored
    assert {values[s["value"]] for s in graph["params"]} == {"bfloat16"}  # what the traced ops read
    from safetensors.torch import load_file
    weights = load_file(str(next(tmp_path.rglob(WEIGHTS_FILE))))
    assert all(weights[n].dtype == torch.float32 and torch.equal(weights[n], v) for n, v in before.items())


@pytest.mark.parametrize("policy, use_zero, kw, match", [
    (BF16, True, {}, r"pas_config\['zero3_mixed_precision'\] needs ComputeConfig\(use_zero=3\) for training"),
    (BF16, 3, {"inference_only": True}, r"needs ComputeConfig\(use_zero=3\) for training.*inference_only=True"),
    ({"param_dtype": "bf8"}, 3, {}, r"\['param_dtype'\] is 'bf8': give a floating dtype by name"),
    ({"reduce": "fp32"}, 3, {}, r"unknown key\(s\) 'reduce'"),
])
def test_bad_settings_refused_before_generation(tmp_path, policy, use_zero, kw, match):
    """By ComputeConfig (so the Trainer refuses them before any worker starts), and by parallelize."""
    with pytest.raises(ConfigError, match=match):
        parallelize(hf_models.make("llama", dtype=torch.float32), _dummy(), "dp", _cfg(policy, use_zero, **kw),
                    gen_savedir=tmp_path, load_module=False)
    assert not list(tmp_path.rglob(gencode_file(0)))  # refused before anything is generated


def test_reuse_graph_keeps_no_graph_traced_in_another_dtype(tmp_path):
    """reuse='graph' keeps graph.json when what shapes the graph is unchanged: the mixed precision
    setting is part of that (the graph's dtypes), so adding or dropping it traces again."""
    def traced_dtypes(policy):
        cfg = _cfg(policy) if policy is not None else ComputeConfig(1, 2, trace_strategy="cpu", use_zero=3)
        parallelize(hf_models.make("llama", dtype=torch.float32), _dummy(), "dp", cfg, gen_savedir=tmp_path,
                    reuse="graph", instance_name="one", load_module=False)
        graph = json.loads(next(tmp_path.rglob(GRAPH_FILE)).read_text())
        values = {v[0]: v[4] for v in graph["values"]}
        return {values[s["value"]] for s in graph["params"]}
    assert traced_dtypes(None) == {"float32"}
    assert traced_dtypes(BF16) == {"bfloat16"}  # traced again, in bf16
    assert traced_dtypes({**BF16, "reduce_dtype": "bfloat16"}) == {"bfloat16"}
    assert traced_dtypes(None) == {"float32"}  # and back
