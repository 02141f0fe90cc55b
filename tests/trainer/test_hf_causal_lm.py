"""`nnscaler.trainer.hf.CausalLM`: transformers' own causal-LM loss (labels default to the inputs,
padding ignored); weights from `from_pretrained` give the Trainer's first-step loss equal to
transformers' forward; its checkpoints carry the HFRecord (config, tied names, the dataset's
tokenizer) that `merge --hf` turns into a `from_pretrained` directory; bad arguments name the key."""
from __future__ import annotations

import json
import os

import pytest
import torch

from loop_helpers import run_trainer
from nnscaler.ckpt import HF_EXTRA_KEY, merge
from nnscaler.trainer import TrainerConfigError
from nnscaler.trainer.hf import CausalLM

transformers = pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKENIZER = os.path.join(ROOT, "examples", "trainer", "hf_llama")
VOCAB = 512  # the example tokenizer's


def tiny_llama(folder, seed=7):
    """A tiny Llama saved by transformers (random weights from `seed`); returns the folder."""
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=True, bos_token_id=0, eos_token_id=0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
    return str(folder)


def test_loss_is_transformers_own_with_padding_ignored(tmp_path):
    folder = tiny_llama(tmp_path / "pre")
    model = CausalLM(config=folder, from_pretrained=folder).eval()
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = torch.randint(1, VOCAB, (2, 10), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    with torch.no_grad():
        assert model({"input_ids": ids}) == pytest.approx(ref(input_ids=ids, labels=ids).loss.item(), rel=1e-6)
        want = ref(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss.item()
        assert model({"input_ids": ids, "attention_mask": mask}) == pytest.approx(want, rel=1e-6)
        labels = torch.roll(ids, 1, dims=1)
        assert model({"input_ids": ids, "labels": labels}) == pytest.approx(
            ref(input_ids=ids, labels=labels).loss.item(), rel=1e-6)


@pytest.mark.parametrize("kind", ["qwen2", "mistral", "gpt2"])
def test_other_architectures_give_their_own_loss(tmp_path, kind):
    small = dict(vocab_size=VOCAB, num_hidden_layers=2, num_attention_heads=4)
    config = {"qwen2": lambda: transformers.Qwen2Config(hidden_size=32, intermediate_size=64, num_key_value_heads=2,
                                                        **small),
              "mistral": lambda: transformers.MistralConfig(hidden_size=32, intermediate_size=64,
                                                            num_key_value_heads=2, **small),
              "gpt2": lambda: transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4)}[kind]()
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / kind)
    model = CausalLM(config=str(tmp_path / kind), from_pretrained=str(tmp_path / kind)).eval()
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / kind).eval()
    assert type(model.model) is type(ref)
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert model({"input_ids": ids}) == pytest.approx(ref(input_ids=ids, labels=ids).loss.item(), rel=1e-6)


def test_first_step_loss_from_pretrained_weights_and_merge_hf(tmp_path):
    folder = tiny_llama(tmp_path / "pre")
    text = tmp_path / "text.txt"
    text.write_text(open(os.path.join(ROOT, "docs", "trainer.md")).read()[:1500])
    data_args = {"files": str(text), "tokenizer": TOKENIZER, "block_size": 16, "split": "all",
                 "cache_dir": str(tmp_path / "cache")}
    from nnscaler.trainer.hf import TokenizedText
    blocks = TokenizedText(**data_args).blocks
    n = len(blocks)
    data = {
        "compute_config": {"plan_ngpus": 1, "runtime_ngpus": 1, "use_end2end": True, "trace_strategy": "cpu"},
        "pas_policy": "dp", "seed": 0, "gen_savedir": f"{tmp_path}/gen", "instance_name": "hf",
        "micro_batch_size": n, "global_batch_size": n, "max_train_steps": 1, "enable_progress_bar": False,
        "model": {"type": "nnscaler.trainer.hf.CausalLM", "args": {"config": folder, "from_pretrained": folder}},
        "optimizer": {"type": "torch.optim.AdamW", "args": {"lr": 0.01}},
        "dataset": {"type": "nnscaler.trainer.hf.TokenizedText", "train_args": data_args},
        "dataset_sampler": {"train_args": {"shuffle": False}},
        "checkpoint": {"save_dir": f"{tmp_path}/ckpt", "every_n_train_steps": 1},
        "hook": {"type": "trainer_models.RecordingHook"},
    }
    losses, _, _ = run_trainer(data)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        want = ref(input_ids=blocks, labels=blocks).loss.item()
    assert losses[0] == pytest.approx(want, rel=1e-5)
    out = merge(tmp_path / "ckpt" / "last", tmp_path / "hf", hf=True)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "manifest.json",
                                                     "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    trained = transformers.AutoModelForCausalLM.from_pretrained(out)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer.vocab_size == VOCAB
    prompt = tokenizer("The Trainer", return_tensors="pt")
    generated = trained.generate(**prompt, max_new_tokens=3, do_sample=False)
    assert generated.shape == (1, prompt["input_ids"].shape[1] + 3)
    changed = [n for n, p in trained.state_dict().items() if not torch.equal(p, ref.state_dict()[n])]
    assert "model.embed_tokens.weight" in changed and len(changed) == len(ref.state_dict())  # one AdamW step


def test_record_names_the_tied_weights_and_prefix(tmp_path):
    folder = tiny_llama(tmp_path / "pre")
    model = CausalLM(config=os.path.join(folder, "config.json"), tokenizer=TOKENIZER, dtype="float64")
    assert all(p.dtype == torch.float64 for p in model.parameters())
    rec = model.hf_record()
    assert rec.prefix == "model." and rec.tied == ("lm_head.weight",)
    assert set(rec.tokenizer) == {"tokenizer.json", "tokenizer_config.json"}
    config = json.loads(rec.config)
    assert config["dtype"] == "float64" and config["architectures"] == ["LlamaForCausalLM"]
    assert config.get("use_cache", True) is True and model.model.config.use_cache is False
    extra = {}
    model.on_save_checkpoint(type("T", (), {"rank": 1, "train_dataset": None})(), extra)
    assert extra[HF_EXTRA_KEY]["tokenizer"] == {}  # only rank 0 stores the files


@pytest.mark.parametrize("args,key,match", [
    (dict(config="no/such/dir"), "model.args.config", "neither a config.json file nor a directory"),
    (dict(dtype="int8"), "model.args.dtype", "not one of"),
    (dict(from_pretrained="no/such/dir"), "model.args.from_pretrained", "not a directory"),
    (dict(tokenizer="no/such/dir"), "model.args.tokenizer", "not a directory"),
])
def test_bad_arguments_name_the_key(tmp_path, args, key, match):
    kwargs = dict(config=tiny_llama(tmp_path / "pre"))
    kwargs.update(args)
    with pytest.raises(TrainerConfigError, match=match) as e:
        CausalLM(**kwargs)
    assert e.value.key == key


def test_pretrained_on_meta_is_left_for_the_trainer_to_load(tmp_path):
    folder = tiny_llama(tmp_path / "pre")
    with torch.device("meta"):  # what the Trainer does when the plan shards parameters (builds_on_meta)
        model = CausalLM(config=folder, pretrained=folder)
    assert model.weights_to_load == folder and all(p.is_meta for p in model.parameters())
    assert CausalLM(config=folder, pretrained=folder).weights_to_load is None  # loaded by from_pretrained
    with pytest.raises(TrainerConfigError, match="same setting") as e:
        CausalLM(config=folder, pretrained=folder, from_pretrained=folder)
    assert e.value.key == "model.args.pretrained"
    os.remove(os.path.join(folder, "model.safetensors"))
    with pytest.raises(TrainerConfigError, match="holds no model.safetensors") as e, torch.device("meta"):
        CausalLM(config=folder, pretrained=folder)
    assert e.value.key == "model.args.pretrained"
