"""Long context in the Trainer: `nnscaler.trainer.hf.CausalLM` under ``pas_policy: cp``.

- The example (examples/trainer/hf_long_context.yaml: a tiny Llama, context parallelism over 2 gloo
  processes; here 4 steps of 512-token sequences of docs/trainer.md alone, tokenized at once) trains,
  validates and checkpoints, every rank's generated code runs ring attention, and step 1's loss is
  transformers' own forward of the same weights on the same sequence in this process: one launch.
- Bad input is refused before any worker starts, one line naming the value and the fix: attention
  other than sdpa (the argument, the config's own, an architecture without sdpa), attention dropout,
  a block_size (train or val) that is not a multiple of 2 x cp; other policies accept them all.
"""
from __future__ import annotations

import glob
import os
import re

import pytest
import torch

from nnscaler.trainer import TrainerArgs, TrainerConfigError
from nnscaler.trainer.loggers.event_file import read_scalars
from cli_workers import train_in_workers
from test_cli import HERE

transformers = pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(HERE))
EXAMPLE = os.path.join(ROOT, "examples", "trainer", "hf_long_context.yaml")
LINE = re.compile(r"^epoch \d+ step (\d+)/\d+ \| loss ([0-9.]+) \|", re.M)


def _example(*overrides, validate=True):
    cwd = os.getcwd()
    os.chdir(ROOT)  # the example's paths are relative to the repository root
    try:
        return TrainerArgs.from_yaml(EXAMPLE, list(overrides), validate=validate)
    finally:
        os.chdir(cwd)


def _reference_step_1(args):
    """The loss of transformers' forward (sdpa, one process) of the example's initial weights on
    its first micro-batch."""
    from hf_runs import first_batch_and_model
    batch, model = first_batch_and_model(args, whole=True)
    assert model.model.config._attn_implementation == "sdpa"
    with torch.no_grad():  # packed (pack: true): documents apart, as the example trains
        return model.model(**batch).loss.item()


@pytest.mark.multiprocess
def test_hf_long_context_example_trains_under_cp_with_ring_attention(tmp_path):
    run = tmp_path / "run"
    data = [f"--dataset.{split}_args.{key}={value}" for split in ("train", "val")  # two docs: tokenized in 0.1 s
            for key, value in (("files", "[\"docs/long-context.md\", \"docs/trainer.md\"]"),
                               ("cache_dir", tmp_path / "datasets"))]
    argv = ["--vars.run_dir", str(run), "--vars.block_size", "512", "--max_train_steps", "4",
            "--val_every_n_train_steps", "2", "--checkpoint.every_n_train_steps", "4", "--enable_progress_bar",
            "false", *data]
    r = train_in_workers("-f", EXAMPLE, "--nproc", "2", *argv, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    steps = [(int(s), float(loss)) for s, loss in LINE.findall(r.stdout)]
    assert [s for s, _ in steps] == [1, 2, 3, 4], r.stdout
    assert steps[-1][1] < steps[0][1] and r.stdout.count("val_loss") == 2
    assert os.readlink(run / "checkpoints" / "last") == "0000-0004"
    code = [open(p).read() for p in glob.glob(str(run / "gen" / "**" / "gencode*.py"), recursive=True)]
    assert len(code) == 2 and all(c.count("nr.ring_attention.attention(") >= 2 for c in code)  # 2 layers
    [events] = glob.glob(str(run / "tensorboard" / "train" / "events.*"))
    logged = {step: value for step, tag, value in read_scalars(events) if tag == "loss"}
    assert logged[1] == pytest.approx(steps[0][1], abs=1e-4)
    assert logged[1] == pytest.approx(_reference_step_1(_example(*argv)), rel=1e-5)


LLAMA = {"model_type": "llama", "vocab_size": 512, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 1, "num_attention_heads": 2}


@pytest.mark.parametrize("overrides,key,says", [
    (["--model.args.attn_implementation", "eager"], "model.args.attn_implementation",
     ["is 'eager', but pas_policy 'cp' runs every attention as ring attention",
      "scaled_dot_product_attention", "set it to sdpa"]),
    (["--model.args.attn_implementation!", "--model.args.config.attn_implementation", "eager"], "model.args.config",
     ["asks for attn_implementation 'eager' (the mapping)", "set model.args.attn_implementation to sdpa"]),
    (["--model.args.config", repr(dict(LLAMA, model_type="bloom", n_layer=1, n_head=2))], "pas_policy",
     ["BloomForCausalLM has no sdpa attention", "use dp, tp or another policy"]),
    (["--model.args.config.attention_dropout", "0.1"], "model.args.config",
     ["attention_dropout is 0.1", "no attention dropout", "--model.args.config.attention_dropout 0"]),
    (["--model.args.config", repr({"model_type": "gpt2", "vocab_size": 512, "n_embd": 32, "n_layer": 1,
                                   "n_head": 2, "bos_token_id": 0, "eos_token_id": 0})], "model.args.config",
     ["attn_pdrop is 0.1"]),  # GPT-2's default
    (["--vars.block_size", "1022"], "dataset.train_args.block_size",
     ["is 1022", "2 x cp = 4 equal chunks (cp 2 = plan_ngpus 2", "use block_size 1020 or 1024"]),
    (["--dataset.val_args.block_size", "6"], "dataset.val_args.block_size", ["is 6", "use block_size 4 or 8"]),
    (["--compute_config.plan_ngpus", "4", "--compute_config.runtime_ngpus", "4", "--vars.block_size", "4092"],
     "dataset.train_args.block_size", ["2 x cp = 8 equal chunks (cp 4 = plan_ngpus 4", "use block_size 4088 or 4096"]),
    (["--model.args.attn_implementation", "sdpa", "--model.args.config.attn_implementation", "eager"], None, []),
    (["--vars.block_size", "1024", "--model.args.config", repr(dict(LLAMA, attention_dropout=0.0))], None, []),
    (["--pas_policy", "dp", "--model.args.attn_implementation", "eager", "--model.args.config.attention_dropout",
      "0.1", "--vars.block_size", "1022"], None, []),  # no ring attention: anything goes
])
def test_bad_cp_config_is_refused_before_any_worker(overrides, key, says):
    from hf_runs import assert_config_verdict
    assert_config_verdict(_example, overrides, key, says)


def test_cp_size_is_per_pipeline_stage():
    args = _example("--compute_config.plan_ngpus", "4", "--compute_config.runtime_ngpus", "4", "--vars.block_size",
                    "1028", "--global_batch_size", "2", validate=False)
    args.compute_config.pas_config.update(pp_size=2, pipeline_nmicros=2)  # 2 stages of cp 2
    args.validate()
    args.compute_config.pas_config.update(pp_size=1, pipeline_nmicros=None)  # cp 4: 1028 is not a multiple of 8
    with pytest.raises(TrainerConfigError, match="2 x cp = 8 equal chunks"):
        args.validate()


def test_the_command_prints_one_line_and_starts_no_worker(tmp_path, capsys, monkeypatch):
    from hf_runs import assert_refused_in_one_line
    assert_refused_in_one_line(EXAMPLE, str(tmp_path), [
        ["--model.args.attn_implementation", "eager"], ["--model.args.config.attention_dropout", "0.1"],
        ["--vars.block_size", "4094"],
    ], capsys, monkeypatch)
