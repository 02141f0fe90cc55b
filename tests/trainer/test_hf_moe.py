"""Mixture-of-experts models in the Trainer: `nnscaler.trainer.hf.CausalLM` with a Mixtral config.

- The example (examples/trainer/hf_moe.yaml: a tiny Mixtral, 4 experts, top-2, ``pas_policy: ep``
  on 2 gloo processes; 4 steps on docs/trainer.md alone, tokenized at once) trains, validates and
  checkpoints; its console line and TensorBoard events carry ``aux_loss`` and
  ``expert_imbalance`` every step, and step 1's numbers are those of transformers' own forward of
  the same weights on the same batch in this process (loss = next-token loss + coef x aux_loss;
  imbalance = the busiest expert's tokens over the mean, from the router's top-2, averaged over the
  layers): one launch.
- Bad input is refused before any worker starts, one line naming the value and the fix (top-k above
  the experts; ``ep`` with a dense model; experts not divisible by the ep size); ``ep`` on a model
  the policy finds no experts in is refused by the policy in the workers, one line, exit code 2.
- The pieces: the console line, the logged scalars, `MoEMeter` on recorded outputs and load.
- DeepSeek-V3 with ``load_balance_coeff`` and ``capacity_factor`` (one launch): the checkpoint's
  router bias moved by whole steps of the coefficient, the experts got the capacity; both options
  checked (a number in range, a model they apply to).
"""
from __future__ import annotations

import glob
import os
import re

import pytest
import torch

from nnscaler.trainer import MoEMetrics, TrainerArgs, TrainStepMetrics
from nnscaler.trainer.loggers.console import format_train_line
from nnscaler.trainer.loggers.event_file import read_scalars
from nnscaler.trainer.moe import MoEMeter
from cli_workers import train_in_workers
from test_cli import HERE, nnscaler, write

transformers = pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(HERE))
EXAMPLE = os.path.join(ROOT, "examples", "trainer", "hf_moe.yaml")
LINE = re.compile(r"^epoch \d+ step (\d+)/\d+ \| loss ([0-9.]+) \| aux_loss ([0-9.]+) \| expert_imbalance ([0-9.]+) \|",
                  re.M)


def _reference_step_1(args):
    """transformers' forward of the example's initial weights on its first batch (one process):
    (loss, aux_loss, expert imbalance)."""
    from hf_runs import first_batch_and_model
    batch, model = first_batch_and_model(args)
    with torch.no_grad():
        out = model.model(input_ids=batch, labels=batch, output_router_logits=True)
    experts = model.experts
    ratios = []
    for logits in out.router_logits:
        chosen = torch.topk(torch.softmax(logits.float(), -1), experts.top_k, dim=-1).indices
        counts = torch.bincount(chosen.reshape(-1), minlength=experts.count).double()
        ratios.append(float(counts.max() / counts.mean()))
    return out.loss.item(), out.aux_loss.item(), sum(ratios) / len(ratios)


@pytest.mark.multiprocess
def test_hf_moe_example_trains_under_ep_and_logs_aux_loss_and_expert_load(tmp_path):
    run = tmp_path / "run"
    data = [f"--dataset.{split}_args.{key}={value}" for split in ("train", "val")  # one doc: tokenized in 0.1 s
            for key, value in (("files", "docs/trainer.md"), ("cache_dir", tmp_path / "datasets"))]
    argv = ["--vars.run_dir", str(run), "--max_train_steps", "4", "--val_every_n_train_steps", "2",
            "--checkpoint.every_n_train_steps", "4", "--enable_progress_bar", "false", *data]
    r = train_in_workers("-f", EXAMPLE, "--nproc", "2", *argv, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    steps = [(int(s), float(loss), float(aux), float(imb)) for s, loss, aux, imb in LINE.findall(r.stdout)]
    assert [s[0] for s in steps] == [1, 2, 3, 4], r.stdout
    assert steps[-1][1] < steps[0][1] and r.stdout.count("val_loss") == 2
    [events] = glob.glob(str(run / "tensorboard" / "train" / "events.*"))
    logged = {}
    for step, tag, value in read_scalars(events):
        logged.setdefault(tag, {})[step] = value
    assert sorted(logged["aux_loss"]) == sorted(logged["expert_imbalance"]) == [1, 2, 3, 4]
    for step, loss, aux, imbalance in steps:  # the console prints what TensorBoard holds
        assert logged["loss"][step] == pytest.approx(loss, abs=1e-4)
        assert logged["aux_loss"][step] == pytest.approx(aux, abs=1e-4)
        assert logged["expert_imbalance"][step] == pytest.approx(imbalance, abs=5e-3)
        assert 1.0 <= logged["expert_imbalance"][step] <= 2.0  # top-2 of 4: an expert takes at most every token
    assert os.readlink(run / "checkpoints" / "last") == "0000-0004"
    cwd = os.getcwd()
    os.chdir(ROOT)  # the example's paths are relative to the repository root
    try:
        args = TrainerArgs.from_yaml(EXAMPLE, argv)
        loss, aux, imbalance = _reference_step_1(args)
    finally:
        os.chdir(cwd)
    assert logged["loss"][1] == pytest.approx(loss, rel=1e-5)  # transformers' loss: includes coef x aux_loss
    assert logged["aux_loss"][1] == pytest.approx(aux, rel=1e-5)
    assert logged["expert_imbalance"][1] == pytest.approx(imbalance, rel=1e-6)


def _example(*overrides):
    from hf_runs import example_args
    return example_args("hf_moe.yaml", *overrides)


@pytest.mark.parametrize("overrides,key,says", [
    (["--model.args.config.num_experts_per_tok", "5"], "model.args.config",
     ["num_experts_per_tok is 5 but the model has 4 experts (num_local_experts)", "between 1 and 4"]),
    (["--model.args.config.num_local_experts", "3"], "compute_config.plan_ngpus",
     ["3 experts (num_local_experts) over the expert-parallel size 2", "use plan_ngpus 3"]),
    (["--model.args.config.num_local_experts", "3", "--compute_config.pas_config.ep_size", "1"],
     None, []),  # ep_size 1: every expert on every rank, nothing to divide
    (["--model.args.config", "examples/trainer/hf_llama"], "pas_policy",
     ["'ep' splits the experts", "'llama' model of model.args.config has none", "use dp, tp"]),
    (["--model.args.config.num_local_experts", "8", "--compute_config.plan_ngpus", "4",
      "--compute_config.runtime_ngpus", "4", "--compute_config.pas_config.pp_size", "2"],
     None, []),  # ep 2 inside each of 2 stages: 8 experts split
    (["--pas_policy", "cp"], None, []),  # cp 2 on the MoE model: its 4 experts split over both ranks
    (["--pas_policy", "cp", "--model.args.config.num_local_experts", "3"], "compute_config.pas_config.ep_size",
     ["is 2 (a stage of plan_ngpus / pp_size devices): pas_policy 'cp' splits each layer's 3 experts",
      "set pas_config.ep_size to 1"]),
    (["--pas_policy", "cp", "--model.args.config.num_local_experts", "3", "--compute_config.pas_config.ep_size", "1"],
     None, []),  # every expert on every rank
    (["--pas_policy", "cp", "--model.args.config.num_local_experts", "6", "--compute_config.plan_ngpus", "4",
      "--compute_config.runtime_ngpus", "4", "--compute_config.pas_config.ep_size", "2"], "compute_config.pas_config.ep_size",
     ["is 2: pas_policy 'cp' splits each layer's 6 experts (num_local_experts) over the 4 devices of a stage",
      "set pas_config.ep_size to 1"]),  # ep_size 2 exchanges inside pairs, but stores the experts over all 4
])
def test_bad_moe_config_is_refused_before_any_worker(overrides, key, says):
    from hf_runs import assert_config_verdict
    assert_config_verdict(_example, overrides, key, says)


def test_the_command_prints_one_line_and_starts_no_worker(tmp_path, capsys, monkeypatch):
    from hf_runs import assert_refused_in_one_line
    assert_refused_in_one_line(EXAMPLE, str(tmp_path), [
        ["--model.args.config.num_experts_per_tok", "5"], ["--model.args.config.num_local_experts", "5"],
        ["--model.args.config", "examples/trainer/hf_llama"],
    ], capsys, monkeypatch)


def test_dense_config_keeps_the_plain_loss():
    from nnscaler.trainer.hf import CausalLM
    dense = CausalLM(config=os.path.join(ROOT, "examples", "trainer", "hf_llama"))
    assert dense.experts is None and dense.aux_loss_output is None
    out = dense({"input_ids": torch.randint(0, 512, (2, 8))})
    assert isinstance(out, torch.Tensor) and out.dim() == 0


def test_moe_config_mapping_returns_loss_and_aux_loss():
    from nnscaler.trainer.hf import CausalLM
    args = _example().model.args
    torch.manual_seed(0)
    model = CausalLM(**args)
    assert model.aux_loss_output == 1 and (model.experts.count, model.experts.top_k) == (4, 2)
    ids = torch.randint(0, 512, (2, 16))
    loss, aux = model({"input_ids": ids})
    plain = model.model(input_ids=ids, labels=ids).loss  # without router logits: the next-token loss alone
    coef = args["config"]["router_aux_loss_coef"]  # the example's
    assert loss.item() == pytest.approx(plain.item() + coef * aux.item(), rel=1e-6)
    assert not aux.requires_grad and 1.0 <= aux.item() <= 4.0
    assert '"model_type": "mixtral"' in model.hf_record(with_tokenizer=False).config


@pytest.mark.multiprocess
def test_ep_on_a_model_without_experts_is_the_policys_one_line(tmp_path):
    cfg = write(tmp_path, **{"pas_policy": "ep", "compute_config.plan_ngpus": 2, "compute_config.runtime_ngpus": 2})
    r = nnscaler("train", "-f", cfg, "--nproc", "2", cwd=tmp_path, timeout=240)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-3000:]
    assert r.stderr.startswith("error: pas_policy 'ep' found no routed-experts op in trainer_models.MLP")
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr


def test_a_rank_relaying_rank_0s_refusal_prints_nothing(capsys, monkeypatch):
    from nnscaler.ir import GenerationError
    from nnscaler.trainer.cli.main import _report
    monkeypatch.setenv("RANK", "1")
    assert _report(GenerationError("rank 0 failed to generate code: PlanError: 3 experts ...")) == 2
    assert _report(GenerationError("rank 0 failed to generate code: KeyError: 'x'")) == 1
    assert capsys.readouterr().err == ""
    assert _report(GenerationError("generated code for rank 1 not found")) == 1
    assert capsys.readouterr().err.startswith("[rank 1] error: generated code for rank 1 not found")


def test_console_line_and_scalars_carry_the_moe_metrics():
    m = TrainStepMetrics(epoch=0, step=3, train_loss=6.2, lr=1e-3, gnorm=0.5,
                         moe=MoEMetrics(aux_loss=2.0123, expert_imbalance=1.4567))
    assert format_train_line(m, 20).startswith("epoch 0 step 3/20 | loss 6.2000 | aux_loss 2.0123 | "
                                               "expert_imbalance 1.46 | lr 1.00e-03 | gnorm 0.500")
    assert m.scalars()["aux_loss"] == 2.0123 and m.scalars()["expert_imbalance"] == 1.4567
    dp = TrainStepMetrics(epoch=0, step=3, train_loss=6.2, lr=1e-3, moe=MoEMetrics(aux_loss=2.0))  # no ep: no load
    assert "aux_loss 2.0000 | lr" in format_train_line(dp, None) and "expert_imbalance" not in dp.scalars()
    assert "aux_loss" not in format_train_line(TrainStepMetrics(epoch=0, step=1, train_loss=1.0, lr=0.1), None)


def test_meter_means_the_aux_loss_and_the_load_and_resets_every_step():
    from nnscaler.runtime.moe import expert_load
    meter = MoEMeter(aux_loss_output=1)
    meter.begin()
    expert_load().add(torch.tensor([4.0, 0.0, 2.0, 2.0]))  # max 4 / mean 2
    expert_load().add(torch.tensor([3.0, 3.0, 1.0, 1.0]))  # 3 / 2
    outputs = [(torch.tensor(5.0), torch.tensor(2.0)), (torch.tensor(6.0), torch.tensor(2.5))]
    assert meter.end(outputs) == MoEMetrics(aux_loss=2.25, expert_imbalance=1.75)
    assert expert_load().per_call == []
    meter.begin()
    assert MoEMeter(aux_loss_output=None).end([torch.tensor(1.0)]) == MoEMetrics()


MIXTRAL = {"model_type": "mixtral", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4,
           "num_experts_per_tok": 2, "max_position_embeddings": 16}


def test_capacity_factor_option_gives_the_experts_a_capacity():
    from nnscaler.ir import ROUTED_EXPERTS, trace
    from nnscaler.trainer.errors import TrainerConfigError
    from nnscaler.trainer.hf import CausalLM
    model = CausalLM(MIXTRAL, dtype="float64", capacity_factor=1.25)
    ids = torch.randint(0, 64, (2, 8))
    ops = [n for n in trace(model.model, {"input_ids": ids}).nodes if n.target == ROUTED_EXPERTS]
    assert [n.kwargs.get("capacity_factor") for n in ops] == [1.25, 1.25]
    assert all(n.kwargs.get("capacity_factor") is None
               for n in trace(CausalLM(MIXTRAL, dtype="float64").model, {"input_ids": ids}).nodes
               if n.target == ROUTED_EXPERTS)  # off by default: dropless
    for bad in (0, -1, "1.25", True):
        with pytest.raises(TrainerConfigError, match=r"model\.args\.capacity_factor.*not a number > 0.*dropless"):
            CausalLM(MIXTRAL, capacity_factor=bad)
    dense = {k: v for k, v in MIXTRAL.items() if "expert" not in k} | {"model_type": "llama"}
    with pytest.raises(TrainerConfigError, match=r"model\.args\.capacity_factor.*LlamaForCausalLM has no experts"):
        CausalLM(dense, capacity_factor=1.0)


DEEPSEEK_V3 = {"model_type": "deepseek_v3", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
               "moe_intermediate_size": 24, "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2,
               "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1, "q_lora_rank": 16, "kv_lora_rank": 16,
               "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 16}


def test_load_balance_coeff_option_is_checked():
    from nnscaler.trainer.errors import TrainerConfigError
    from nnscaler.trainer.hf import CausalLM
    assert CausalLM(DEEPSEEK_V3, load_balance_coeff=1e-3).load_balance_coeff == 1e-3
    assert CausalLM(DEEPSEEK_V3).load_balance_coeff is None  # off by default
    for bad in (-1, "0.001", True):
        with pytest.raises(TrainerConfigError, match=r"model\.args\.load_balance_coeff.*not a number >= 0"):
            CausalLM(DEEPSEEK_V3, load_balance_coeff=bad)
    with pytest.raises(TrainerConfigError, match=r"load_balance_coeff.*MixtralForCausalLM has no router bias"):
        CausalLM(MIXTRAL, load_balance_coeff=1e-3)


@pytest.mark.multiprocess
def test_deepseek_v3_balances_and_drops_under_ep_in_the_trainer(tmp_path):
    """The example's run with a tiny DeepSeek-V3, model.args.load_balance_coeff and capacity_factor:
    after 2 steps the checkpoint's router bias moved by multiples of the coefficient (each step +-coeff
    or 0 per expert, not all 0), and the generated code passes the capacity to the experts."""
    import yaml
    from safetensors.torch import load_file
    with open(EXAMPLE) as f:
        cfg = yaml.safe_load(f)
    coeff = 0.01
    cfg["model"]["args"] = {"dtype": "float32", "load_balance_coeff": coeff, "capacity_factor": 1.5,
                            "config": dict(DEEPSEEK_V3, vocab_size=512, max_position_embeddings=256, bos_token_id=0,
                                           eos_token_id=0, pad_token_id=0)}
    path = tmp_path / "deepseek.yaml"
    path.write_text(yaml.safe_dump(cfg))
    run = tmp_path / "run"
    # a text of its own, not a doc that changes: on some batches the router's counts come out equal, and
    # the sign rule then rightly moves no bias
    text = tmp_path / "text.md"
    text.write_text(" ".join(f"word{i % 37} token{i % 11} {'moe' * (i % 3)}" for i in range(3000)))
    argv = ["--vars.run_dir", str(run), "--max_train_steps", "2", "--val_every_n_train_steps", "2",
            "--checkpoint.every_n_train_steps", "2", "--enable_progress_bar", "false",
            *[f"--dataset.{split}_args.{key}={value}" for split in ("train", "val")
              for key, value in (("files", text), ("cache_dir", tmp_path / "datasets"))]]
    r = train_in_workers("-f", path, "--nproc", "2", *argv, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "expert_imbalance" in r.stdout
    gencode = glob.glob(str(run / "gen" / "**" / "gencode0.py"), recursive=True)
    assert gencode and "capacity_factor=1.5" in open(gencode[0]).read()
    from nnscaler.ckpt import merge
    merge(run / "checkpoints" / "last", tmp_path / "merged")
    [bias] = [v for k, v in load_file(str(tmp_path / "merged" / "model.safetensors")).items()
              if k.endswith("e_score_correction_bias")]
    steps = bias / coeff  # initialised to 0: each step moved every expert by -1, 0 or +1
    assert torch.allclose(steps, steps.round(), atol=1e-4) and steps.abs().max() <= 2 and steps.abs().sum() > 0
