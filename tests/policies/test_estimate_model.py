"""The model seen by the estimate (nnscaler.policies.estimate.model): read from a Hugging Face
config.json, counted on the meta device."""
from __future__ import annotations

import json

import pytest
import torch

from nnscaler.policies.estimate import ModelConfigError, ModelSpec

LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 128, "max_position_embeddings": 64}
GPT2 = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 100, "n_positions": 32}


def write(tmp_path, data, name="config.json"):
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def real_count(data):
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.manual_seed(0)
    return sum(p.numel() for p in AutoModelForCausalLM.from_config(AutoConfig.for_model(**data)).parameters())


def test_llama_config(tmp_path):
    spec = ModelSpec.from_hf_config(write(tmp_path, LLAMA))
    assert (spec.hidden, spec.layers, spec.heads, spec.kv_heads, spec.head_dim, spec.ffn, spec.vocab) == \
        (64, 3, 4, 2, 16, 96, 128)
    assert spec.gated and not spec.tied and spec.layer_class == "LlamaDecoderLayer"
    assert spec.total_params == real_count(LLAMA)  # counted on the meta device
    assert spec.layers * spec.layer_params + 2 * spec.embedding_params + spec.hidden == spec.total_params


def test_gpt2_config_from_its_folder(tmp_path):
    write(tmp_path, GPT2)
    spec = ModelSpec.from_hf_config(tmp_path)
    assert not spec.gated and spec.tied and spec.ffn == 256 and spec.layer_class == "GPT2Block"
    assert spec.total_params == real_count(GPT2)


def test_bad_configs(tmp_path):
    with pytest.raises(ModelConfigError, match="cannot read the model config .*nope.json"):
        ModelSpec.from_hf_config(tmp_path / "nope.json")
    with pytest.raises(ModelConfigError, match="is not valid JSON"):
        ModelSpec.from_hf_config(_text(tmp_path, "{oops"))
    with pytest.raises(ModelConfigError, match="has no 'model_type'"):
        ModelSpec.from_hf_config(write(tmp_path, {"hidden_size": 8}, "plain.json"))
    moe = dict(LLAMA, model_type="mixtral", num_local_experts=8, num_experts_per_tok=9)  # (test_estimate_moe.py)
    with pytest.raises(ModelConfigError, match="moe.json: 'num_experts_per_tok' \\(9\\) exceeds the 8 routed experts"):
        ModelSpec.from_hf_config(write(tmp_path, moe, "moe.json"))


def _text(tmp_path, text):
    path = tmp_path / "broken.json"
    path.write_text(text)
    return path
