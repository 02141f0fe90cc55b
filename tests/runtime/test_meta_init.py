"""parallelize() of a module built on the meta device, filled on the rank from its own
initialisation (runtime/driver/meta_init.py): the values, and torch's generator afterwards, are
those of the module built on the CPU with the same seed; a tensor nothing can initialize is
refused by name (single process)."""
from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn as nn

from nnscaler import ComputeConfig, parallelize
from nnscaler.ir import ConfigError

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models"))
import hf_models  # noqa: E402


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.blocks = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 8, bias=False))
        self.head = nn.Linear(8, 16)

    def forward(self, ids):
        return self.head(self.blocks(self.emb(ids))).logsumexp(-1).mean()


def _full_values(pm):
    return {e.full_name: getattr(pm, local) for local, e in pm.fullmap.items()}


def _expect_cpu_build(build, args, tmp_path, seed=3):
    torch.manual_seed(seed)
    cpu = build()
    after_cpu = torch.rand(4)
    torch.manual_seed(seed)
    with torch.device("meta"):
        meta = build()
    pm = parallelize(meta, args, "dp", ComputeConfig(1, 1), gen_savedir=tmp_path)
    assert torch.equal(torch.rand(4), after_cpu)  # the generator is left where the CPU build leaves it
    reference = {**dict(cpu.named_parameters()), **dict(cpu.named_buffers())}
    values = _full_values(pm)
    assert values.keys() <= reference.keys() and len(values) > 3
    for name, value in values.items():
        assert torch.equal(value, reference[name]), name
    assert all(t.is_meta for t in meta.parameters())  # the user's module stays on meta
    assert torch.equal(pm(**args), cpu(**args))
    return pm


def test_torch_layers_initialize_as_built_on_the_cpu(tmp_path):
    _expect_cpu_build(Net, {"ids": torch.randint(0, 16, (2, 5))}, tmp_path)


@pytest.mark.parametrize("tied", [False, True])
def test_hf_llama_initializes_as_built_on_the_cpu(tmp_path, tied):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=hf_models.VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=hf_models.SEQ,
                      attn_implementation="sdpa", use_cache=False, tie_word_embeddings=tied)

    def build():
        return hf_models.CausalLM(LlamaForCausalLM(cfg))
    ids = torch.randint(0, hf_models.VOCAB, (2, hf_models.SEQ), generator=torch.Generator().manual_seed(0))
    pm = _expect_cpu_build(build, {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)}, tmp_path)
    assert ("model.lm_head.weight" in pm.full_aliases) == tied


def test_without_init_only_the_non_persistent_buffers_are_filled(tmp_path):
    ids = torch.randint(0, hf_models.VOCAB, (2, hf_models.SEQ))
    torch.manual_seed(0)
    cpu = hf_models.llama()
    with torch.device("meta"):
        meta = hf_models.llama()
    state = torch.get_rng_state()
    pm = parallelize(meta, {"input_ids": ids, "labels": ids}, "dp", ComputeConfig(1, 1), gen_savedir=tmp_path,
                     init_module_params=False)
    assert torch.equal(torch.get_rng_state(), state)  # nothing random ran
    values = _full_values(pm)
    assert torch.equal(values["model.model.rotary_emb.inv_freq"], cpu.model.model.rotary_emb.inv_freq)


def test_a_meta_tensor_nothing_initializes_is_refused_by_name(tmp_path):
    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.gain = nn.Parameter(torch.ones(8))  # no reset_parameters()

        def forward(self, x):
            return x * self.gain

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.scale = Scale()

        def forward(self, x):
            return self.scale(self.fc(x)).sum()

    with torch.device("meta"):
        model = Model()
    with pytest.raises(ConfigError, match=r"scale \(Scale\) holds the tensor\(s\) gain on the meta device.*"
                                          r"reset_parameters\(\).*init_module_params=False.*nnscaler.ckpt.load"):
        parallelize(model, {"x": torch.randn(2, 8)}, "dp", ComputeConfig(1, 1), gen_savedir=tmp_path)
    pm = parallelize(model, {"x": torch.randn(2, 8)}, "dp", ComputeConfig(1, 1), gen_savedir=tmp_path,
                     init_module_params=False)  # values to come from nnscaler.ckpt.load
    assert "scale.gain" in {e.full_name for e in pm.fullmap.values()}
