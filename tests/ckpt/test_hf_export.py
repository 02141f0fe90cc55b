"""`merge(..., hf=True)` / `nnscaler ckpt merge SRC DST --hf`: a directory that
`AutoModelForCausalLM.from_pretrained` loads, from the HFRecord a checkpoint's extra holds: the
wrapper prefix stripped, tied weights as transformers stores them, config.json, the generation
config and the tokenizer copied; bad input is refused with nothing written."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

from nnscaler.ckpt import HF_EXTRA_KEY, CheckpointError, HFRecord, merge, save
from nnscaler.cli.main import app
from nnscaler.ir.contracts import FullMapEntry, GeneratedAttrs

transformers = pytest.importorskip("transformers")

TOKENIZER = {"tokenizer.json": b'{"fake": true}', "tokenizer_config.json": b"{}"}


class Wrapper(GeneratedAttrs, torch.nn.Module):
    """What the Trainer saves, as a one-rank stand-in for a parallelized module (the contract
    tests/ckpt/fake_modules.py describes): the transformers model's tensors under ``model.``, a
    tied weight once with its alias, plus a buffer of the wrapper's own."""

    COMPUTE_CONFIG = {"plan_ngpus": 1, "runtime_ngpus": 1}
    GRAPH_FINGERPRINT = "fake"

    def __init__(self, model):
        super().__init__()
        self.fullmap, self.full_aliases, local_of = {}, {}, {}
        named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers())
        persistent = set(model.state_dict())
        for name, value in named:
            full = f"model.{name}"
            if id(value) in local_of:
                self.full_aliases[full] = local_of[id(value)]
                continue
            if name not in persistent:
                continue
            local = local_of[id(value)] = f"t{len(self.fullmap)}"
            if isinstance(value, torch.nn.Parameter):
                self.register_parameter(local, torch.nn.Parameter(value.detach().clone()))
            else:
                self.register_buffer(local, value.clone())
            self.fullmap[local] = FullMapEntry(local, full, tuple(value.shape), tuple((0, d) for d in value.shape))
        self.register_buffer("steps", torch.zeros(2))
        self.fullmap["steps"] = FullMapEntry("steps", "steps", (2,), ((0, 2),))


def tiny(kind: str, tie: bool = True):
    torch.manual_seed(0)
    if kind == "llama":
        cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie)
    else:
        cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=16, bos_token_id=0,
                                      eos_token_id=0, tie_word_embeddings=tie)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def record(model, tokenizer=TOKENIZER) -> HFRecord:
    gen = transformers.GenerationConfig.from_model_config(model.config).to_json_string()
    return HFRecord(config=model.config.to_json_string(), prefix="model.", tied=tuple(model.all_tied_weights_keys),
                    generation_config=gen, tokenizer=tokenizer)


def saved(tmp_path, model, rec=None):
    extra = {HF_EXTRA_KEY: rec.to_extra()} if rec is not None else {"other": 1}
    return save(tmp_path / "ck", Wrapper(model), extra=extra)


def stored_keys(folder):
    keys = set()
    for f in folder.glob("model*.safetensors"):
        with safe_open(f, "pt") as h:
            keys |= set(h.keys())
    return keys


@pytest.mark.parametrize("kind,tie,shard", [("llama", True, "5GB"), ("gpt2", True, "20KB"), ("llama", False, "5GB")])
def test_from_pretrained_loads_the_merged_directory(tmp_path, kind, tie, shard):
    model = tiny(kind, tie)
    ck = saved(tmp_path, model, record(model))
    out = merge(ck, tmp_path / "hf", hf=True, max_shard_size=shard)
    model.save_pretrained(tmp_path / "ref")  # what transformers itself stores
    assert stored_keys(out) == stored_keys(tmp_path / "ref")
    assert ("lm_head.weight" in stored_keys(out)) == (not tie)
    assert (out / "model.safetensors.index.json").exists() == (shard != "5GB")
    for name, data in TOKENIZER.items():
        assert (out / name).read_bytes() == data
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == model.config.eos_token_id
    assert not (out / "optimizer.safetensors").exists() and not (out / "rng.safetensors").exists()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(loaded) is type(model)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)
    assert (loaded.lm_head.weight.data_ptr() == loaded.get_input_embeddings().weight.data_ptr()) == tie


def test_overwrite_replaces_an_earlier_hf_merge(tmp_path):
    model = tiny("llama")
    ck = saved(tmp_path, model, record(model, tokenizer={}))
    merge(ck, tmp_path / "hf", hf=True)
    merge(ck, tmp_path / "hf", hf=True, overwrite=True)
    assert not (tmp_path / "hf" / "tokenizer.json").exists()
    assert transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf") is not None


def test_a_merged_checkpoint_merges_with_hf_too(tmp_path):
    model = tiny("llama")
    merged = merge(saved(tmp_path, model, record(model)), tmp_path / "merged")
    out = merge(merged, tmp_path / "hf", hf=True)
    assert stored_keys(out) == {n for n in model.state_dict() if n != "lm_head.weight"}
    assert (out / "tokenizer.json").read_bytes() == TOKENIZER["tokenizer.json"]


def test_cli_hf_flag(tmp_path):
    model = tiny("gpt2")
    ck = saved(tmp_path, model, record(model))
    r = CliRunner().invoke(app, ["ckpt", "merge", str(ck), str(tmp_path / "hf"), "--hf"],
                           env={"COLUMNS": "200", "NO_COLOR": "1"})
    assert r.exit_code == 0, r.output
    assert stored_keys(tmp_path / "hf") == {n for n in model.state_dict() if n != "lm_head.weight"}


def test_a_checkpoint_without_a_record_is_refused(tmp_path):
    ck = saved(tmp_path, tiny("llama"))
    with pytest.raises(CheckpointError, match="records no Hugging Face config.*merge without --hf"):
        merge(ck, tmp_path / "hf", hf=True)
    assert not (tmp_path / "hf").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    r = CliRunner().invoke(app, ["ckpt", "merge", str(ck), str(tmp_path / "hf"), "--hf"],
                           env={"COLUMNS": "200", "NO_COLOR": "1"})
    assert r.exit_code == 1 and "nnscaler.trainer.hf.CausalLM" in r.output and "Traceback" not in r.output


def test_a_wrong_prefix_is_refused(tmp_path):
    model = tiny("llama")
    rec = record(model)
    ck = saved(tmp_path, model, HFRecord(config=rec.config, prefix="net."))
    with pytest.raises(CheckpointError, match="prefix 'net.'"):
        merge(ck, tmp_path / "hf", hf=True)
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("kwargs,match", [
    (dict(config="{not json"), "not JSON"),
    (dict(config='{"vocab_size": 3}'), "no 'model_type'"),
    (dict(config='{"model_type": "llama"}', tokenizer={"config.json": b"{}"}), "'config.json' is not a tokenizer"),
    (dict(config='{"model_type": "llama"}', tokenizer={"../x": b""}), "plain names"),
])
def test_bad_records_are_refused(kwargs, match):
    with pytest.raises(CheckpointError, match=match):
        HFRecord(**kwargs)


def test_record_round_trips_through_extra():
    rec = HFRecord(config='{"model_type": "gpt2"}', prefix="model.", tied=("lm_head.weight",),
                   generation_config="{}", tokenizer={"vocab.json": b"\x00\xffabc", "empty.txt": b""})
    assert HFRecord.from_extra(rec.to_extra()) == rec
    assert HFRecord.from_extra(rec.to_extra(with_tokenizer=False)).tokenizer == {}
