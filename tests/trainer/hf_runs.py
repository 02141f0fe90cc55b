"""The runs of test_hf_multiprocess (importable by spawned workers): examples/trainer/hf_llama.yaml
with a tiny Llama or GPT-2 config, 2 steps under dp 2 or tp 2, a checkpoint at step 2."""
from __future__ import annotations

import os

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "trainer", "hf_llama.yaml")
TOKENIZER = os.path.join(ROOT, "examples", "trainer", "hf_llama")
PLANS = {"dp2": ["--pas_policy", "dp"], "tp2": ["--pas_policy", "tp", "--compute_config.plan_ngpus", "2"],
         "pp2": ["--pas_policy", "pp", "--compute_config.plan_ngpus", "2"],  # pipeline_nmicros: the step's 2
         "dp2-zero3": ["--pas_policy", "dp", "--compute_config.use_zero", "3"],
         # FSDP2's MixedPrecisionPolicy: bf16 gathers and compute from fp32 shards, fp32 gradient reduction
         "dp2-zero3-bf16": ["--pas_policy", "dp", "--compute_config.use_zero", "3",
                            "--compute_config.pas_config.zero3_mixed_precision.param_dtype", "bfloat16",
                            "--compute_config.pas_config.zero3_mixed_precision.reduce_dtype", "float32"]}


def write_configs(folder):
    """Tiny Llama (grouped-query attention, tied) and GPT-2 config directories; {model: dir}."""
    from transformers import GPT2Config, LlamaConfig
    configs = {
        "llama": LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                             tie_word_embeddings=True, bos_token_id=0, eos_token_id=0),
        "gpt2": GPT2Config(vocab_size=512, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0,
                           eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    }
    out = {}
    for name, cfg in configs.items():
        out[name] = os.path.join(folder, name)
        cfg.save_pretrained(out[name])
    return out


def overrides(run_dir, config_dir, plan, text):
    return ["--vars.run_dir", run_dir, "--vars.block_size", "16", "--model.args.config", config_dir,
            "--dataset.train_args.files", text, "--dataset.train_args.tokenizer", TOKENIZER,
            "--dataset.train_args.cache_dir", os.path.join(run_dir, "datasets"), "--dataset.val_args!",
            "--micro_batch_size", "4", "--global_batch_size", "8", "--max_train_steps", "2",
            "--checkpoint.every_n_train_steps", "2", "--enable_progress_bar", "false", *PLANS[plan]]


def write_pretrained(config_dir, out, seed=123):
    """A Llama of `config_dir` with its own weights (not the Trainer's seed's), written by
    save_pretrained to `out` (what ``model.args.pretrained`` loads)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir)).save_pretrained(out)
    return out


def worker(rank, world, runs):
    """Each run in turn; per run: (the parallel model's loss on the first 4 blocks, those blocks,
    this rank's weight pieces, whether the Trainer built the model on the meta device)."""
    from nnscaler.trainer import Trainer, TrainerArgs
    from trainer_models import full_weights
    out = {}
    for label, argv in runs.items():
        trainer = Trainer(train_args=TrainerArgs.from_yaml(EXAMPLE, argv))
        trainer.run()
        batch = trainer.train_dataset.blocks[:4]
        trainer.model.eval()
        n = trainer.train_args.compute_config.pas_config.get("pipeline_nmicros", 1)  # a pipeline takes n samples
        losses = trainer.model.infer_step([({"input_ids": part},) for part in batch.chunk(n)])
        loss = sum(float(x) for x in losses) / n  # equal token counts: the mean of the parts' means
        on_meta = all(p.is_meta for p in trainer.original_model.parameters())
        out[label] = (float(loss), batch, full_weights(trainer.model), on_meta)
    return out


def assert_refused_in_one_line(example: str, run_dir: str, overrides, capsys, monkeypatch) -> None:
    """`nnscaler train -f example --nproc 2 <override>` exits 2 with one `error:` line for each
    override in `overrides`, without starting a worker or writing anything under `run_dir`."""
    import importlib
    import pytest
    cli_main = importlib.import_module("nnscaler.trainer.cli.main")
    monkeypatch.setattr(cli_main, "_launch", lambda *a, **k: pytest.fail("a worker was started"))
    monkeypatch.chdir(ROOT)
    for override in overrides:
        assert cli_main.main(["-f", example, "--nproc", "2", "--vars.run_dir", run_dir, *override]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert not os.listdir(run_dir)


def example_args(example: str, *overrides):
    """TrainerArgs of examples/trainer/`example` with `overrides`, read from the repository root
    (as the README runs the examples: their relative paths resolve there)."""
    from nnscaler.trainer import TrainerArgs
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        return TrainerArgs.from_yaml(os.path.join(ROOT, "examples", "trainer", example), list(overrides))
    finally:
        os.chdir(cwd)


def assert_config_verdict(example, overrides, key, says) -> None:
    """`example(*overrides)` (building and checking the config) passes when `key` is None, else
    raises TrainerConfigError naming `key` whose message holds every text of `says`."""
    import pytest
    from nnscaler.trainer import TrainerConfigError
    if key is None:
        example(*overrides)
        return
    with pytest.raises(TrainerConfigError) as e:
        example(*overrides)
    assert e.value.key == key and all(s in str(e.value) for s in says), str(e.value)


def first_batch_and_model(args, whole=False):
    """(the first micro-batch of `args`' training data on one process, the model `args` builds, seeded
    as the Trainer seeds it before building): what a one-process reference of step 1 runs. The batch
    is the stacked input_ids, or with `whole` every key of the samples stacked (packed samples carry
    position_ids and labels)."""
    from nnscaler.trainer.config.values import build_args
    from nnscaler.trainer.hf import CausalLM, TokenizedText
    from nnscaler.trainer.setup import seed_everything
    data = TokenizedText(**build_args(args.dataset.train_args, "dataset.train_args"))
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
    sampler.set_epoch(0)
    first = [data[i] for i in list(sampler)[:args.micro_batch_size]]
    batch = {k: torch.stack([x[k] for x in first]) for k in first[0]} if whole else \
        torch.stack([x["input_ids"] for x in first])
    seed_everything(args.seed)  # as the Trainer does before it builds the model
    return batch, CausalLM(**build_args(args.model.args, "model.args"))
