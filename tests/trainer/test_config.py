"""TrainerArgs and the component configs: defaults, typed loading, values, validation errors."""
from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from nnscaler.ir import ComputeConfig
from nnscaler.trainer import (CheckpointConfig, DataloaderConfig, DatasetSamplerConfig, HookConfig, HookMapConfig,
                              LRSchedulerConfig, ModelConfig, ModuleParallelizeConfig, OptimizerConfig, TrainerArgs,
                              TrainerConfigError, TrainerConfigWarning, TrainHook)
from nnscaler.trainer.config.values import build_value, guess_value, resolve_object

from loop_helpers import set_dotted


def base(**over):
    data = {
        "compute_config": {"plan_ngpus": 1, "runtime_ngpus": 2, "use_end2end": True},
        "pas_policy": "dp", "seed": 0, "max_epochs": 1, "micro_batch_size": 2,
        "model": {"type": "trainer_models.MLP"},
        "optimizer": {"type": "torch.optim.SGD", "args": {"lr": 0.1}},
        "dataset": {"type": "trainer_models.RandomDataset"},
    }
    return set_dotted(data, over)


def error_of(data) -> TrainerConfigError:
    with pytest.raises(TrainerConfigError) as info:
        TrainerArgs.from_dict(data)
    assert "\n" not in str(info.value)  # one line
    return info.value


def test_seed_defaults():
    a = TrainerArgs()
    assert (a.gen_savedir, a.gen_reuse, a.pas_policy, a.broadcast_strategy, a.run_mode) == \
        ("./.nnscaler", "auto", "autodist", "all", "run")
    assert (a.micro_batch_size, a.val_every_n_epochs, a.enable_progress_bar, a.lr_scheduler, a.hook) == (1, 1, True, None, None)
    assert OptimizerConfig() == OptimizerConfig(None, {}, 0.0, "mean", "mean", None)
    assert DataloaderConfig().type == "torch.utils.data.DataLoader"
    assert DatasetSamplerConfig().type == "torch.utils.data.DistributedSampler"
    assert LRSchedulerConfig().interval == "epoch"
    c = CheckpointConfig()
    assert (c.save_dir, c.no_save, c.save_type, c.save_last, c.save_best, c.symlink_best_and_last) == \
        ("./checkpoints", False, "sharded", True, True, True)
    assert c.async_save is False
    assert {f.name for f in dataclasses.fields(HookMapConfig)} >= {"after_setup", "before_sync_grad", "on_save_checkpoint"}
    assert ModuleParallelizeConfig().compute_config is None and ModelConfig().parallel_modules == []


def test_from_dict_builds_typed_args_and_derived_values():
    a = TrainerArgs.from_dict(base(global_batch_size=8, **{"compute_config.use_zero": "true"}))
    assert isinstance(a.compute_config, ComputeConfig) and a.compute_config.use_zero is True
    assert (a.dp_size, a.update_freq, a.resolved_global_batch_size) == (2, 2, 8)
    assert a.resolved_gen_reuse == "match"
    assert dataclasses.replace(a, run_mode="compile").resolved_gen_reuse == "moo"
    assert TrainerArgs.from_dict(a.to_dict()) == a


def test_hook_union_and_parallel_modules_are_typed():
    a = TrainerArgs.from_dict(base(hook={"on_train_start": "builtins.print"}))
    assert isinstance(a.hook, HookMapConfig)
    a = TrainerArgs.from_dict(base(hook={"type": "nnscaler.trainer.TrainHook"}))
    assert isinstance(a.hook, HookConfig)
    a = TrainerArgs.from_dict(base(**{"model.type": "trainer_models.Outer", "model.parallel_modules": [
        {"type": "trainer_models.Inner", "forward_args_gen_fn": "trainer_models.mlp_forward_args",
         "compute_config": {"use_zero": False}}]}))
    assert a.model.parallel_modules[0].compute_config.use_zero is False


def test_values_type_value_type_and_guessing():
    assert guess_value("1") == 1 and guess_value("[1, 2]") == [1, 2] and guess_value("abc") == "abc"
    assert guess_value("1e-3") == 0.001 and guess_value("true") is True
    assert build_value({"__value_type": "str", "value": 1}, "k") == "1"
    built = build_value({"__type": "trainer_models.MLP", "dim": "8"}, "k")
    assert isinstance(built, torch.nn.Module) and built.layers[0].in_features == 8
    assert build_value({"__type": "ModelConfig", "type": "x"}, "k") == ModelConfig(type="x")
    assert resolve_object("torch.optim.AdamW", "k") is torch.optim.AdamW


@pytest.mark.parametrize("over, key, words", [
    ({"max_epoch": 3}, "", "did you mean 'max_epochs'"),
    ({"optimizer.clip_gnrm": 1.0}, "optimizer", "'clip_gnorm'"),
    ({"compute_config.use_zer": True}, "compute_config", "'use_zero'"),
    ({"micro_batch_size": "many"}, "micro_batch_size", "expected an integer"),
    ({"enable_progress_bar": 3}, "enable_progress_bar", "true or false"),
    ({"collective_timeout": 0}, "collective_timeout", "positive number of seconds"),
    ({"collective_timeout": "soon"}, "collective_timeout", "soon"),
    ({"global_batch_size": 6}, "global_batch_size", "multiple of 4"),
    ({"global_batch_size": 8, "grad_accumulation_steps": 3}, "global_batch_size", "!= micro_batch_size (2) x data-parallel size (2) x grad_accumulation_steps (3)"),
    ({"seed": ...}, "seed", "init_env_fn"),
    ({"pas_policy": "pp", "compute_config.pas_config": {"pipeline_nmicros": 4}}, "compute_config.pas_config.pipeline_nmicros",
     "a step has 1 micro-batches"),
    ({"max_epochs": ...}, "max_epochs", "max_train_steps"),
    ({"model.type": "trainer_models.NoSuchModel"}, "model.type", "does not exist"),
    ({"optimizer.type": "torch.optim.Adamm"}, "optimizer.type", "does not exist"),
    ({"dataset.type": "no_such_pkg.Data"}, "dataset.type", "cannot import"),
    ({"optimizer.grad_reduction": "per-token-mean"}, "optimizer.aggregate_outputs_fn", "per-token-mean"),
    ({"compute_config.use_end2end": False}, "compute_config.use_end2end", "set it to true"),
    ({"compute_config": ...}, "compute_config", "is required"),
    ({"compute_config.plan_ngpus": 2, "compute_config.runtime_ngpus": 3}, "compute_config", "multiple of plan_ngpus"),
    ({"pas_policy": "autodis"}, "pas_policy", "unknown policy 'autodis'; use one of autodist, "),
    ({"optimizer.loss_reduction": "avg"}, "optimizer.loss_reduction", "'mean', 'sum'"),
    ({"checkpoint.save_type": "merged"}, "checkpoint.save_type", "'sharded', 'deduped'"),
    ({"checkpoint.async_save": "maybe"}, "checkpoint.async_save", "expected true or false"),
    ({"precision": "fp8"}, "precision", "not supported"),
    ({"model.type": "trainer_models.count_token_outputs"}, "model.type", "not a factory"),
    ({"hook": {"on_train_strat": "builtins.print"}}, "hook", "on_train_start"),
    ({"model.parallel_modules": [{"type": "trainer_models.Inner", "forward_args_gen_fn": "trainer_models.mlp_forward_args",
                                  "pas_policy": "pp"}]}, "model.parallel_modules.0.pas_policy", "cannot be pipelined"),
    # one optimizer over every parallelized module: their ZeRO settings must agree (refused before any worker)
    ({"model.parallel_modules": [
        {"type": "trainer_models.Inner", "forward_args_gen_fn": "trainer_models.mlp_forward_args",
         "compute_config": {"use_zero": 3}},
        {"type": "torch.nn.Linear", "args": {"in_features": 16, "out_features": 16},
         "forward_args_gen_fn": "trainer_models.mlp_forward_args"}]},
     "model.parallel_modules.1.compute_config.use_zero", "same use_zero, zero_ngroups"),
])
def test_bad_input_names_key_and_fix(over, key, words):
    e = error_of(base(**over))
    assert e.key == key, str(e)
    assert words in str(e), str(e)


def test_async_save_set_in_python_must_be_a_bool():
    args = TrainerArgs.from_dict(base())
    args.checkpoint.async_save = "yes"
    with pytest.raises(TrainerConfigError, match="checkpoint.async_save: expected true or false, got 'yes'"):
        args.validate()


def test_automatic_arguments_are_ignored_with_a_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        TrainerArgs.from_dict(base(**{"dataset_sampler.train_args": {"rank": 3, "shuffle": False},
                                      "dataloader.val_args": {"batch_size": 9}}))
    messages = [str(w.message) for w in caught if issubclass(w.category, TrainerConfigWarning)]
    assert any("dataset_sampler.train_args: rank" in m for m in messages)
    assert any("dataloader.val_args: batch_size" in m for m in messages)


def test_train_hook_lists_every_hook_of_the_map():
    names = {f.name for f in dataclasses.fields(HookMapConfig)}
    assert names == {n for n in vars(TrainHook) if not n.startswith("_")}


def test_pipeline_rules_come_from_the_policy_registry():
    # autodist may pipeline (the registry says so): pipeline_nmicros must match update_freq
    e = error_of(base(**{"pas_policy": "autodist", "compute_config.pas_config": {"pipeline_nmicros": 3}}))
    assert e.key == "compute_config.pas_config.pipeline_nmicros", str(e)
    # ...but it does not need the whole model: a parallel module may use it
    TrainerArgs.from_dict(base(**{"model.type": "trainer_models.Outer", "model.parallel_modules": [
        {"type": "trainer_models.Inner", "forward_args_gen_fn": "trainer_models.mlp_forward_args",
         "pas_policy": "autodist"}]}))
    # a user's registered policy declaring whole_model is refused for a parallel module
    from nnscaler.policies import register_policy, registry
    try:
        register_policy("_whole_model_test", whole_model=True, pipelines=True)(lambda graph, cfg: graph)
        e = error_of(base(**{"model.parallel_modules": [
            {"type": "trainer_models.Inner", "forward_args_gen_fn": "trainer_models.mlp_forward_args",
             "pas_policy": "_whole_model_test"}]}))
        assert e.key == "model.parallel_modules.0.pas_policy" and "cannot be pipelined" in str(e), str(e)
    finally:
        for table in (registry._POLICIES, registry._KEYS, registry._CAPS):
            table.pop("_whole_model_test", None)


def test_use_zero_3_reaches_compute_config_as_the_int_3(tmp_path):
    """YAML ``use_zero: 3`` and ``--compute_config.use_zero 3`` give ComputeConfig the int 3 (fully
    sharded); true / 1 keep meaning ZeRO stage 1, false / 0 none; 2 is refused naming the choices;
    a pipeline policy with use_zero 3 is accepted."""
    import yaml
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(base(**{"compute_config.use_zero": 3})))
    for argv, value, stage in (([], 3, 3), (["--compute_config.use_zero", "3"], 3, 3),
                               (["--compute_config.use_zero", "true"], True, 1),
                               (["--compute_config.use_zero", "1"], 1, 1), (["--compute_config.use_zero"], True, 1),
                               (["--compute_config.use_zero", "0"], 0, 0)):
        cc = TrainerArgs.from_argv(["-f", str(path)] + argv).compute_config
        assert cc.use_zero == value and type(cc.use_zero) is type(value) and cc.zero_stage == stage, argv
    a = TrainerArgs.from_dict(base(**{"model.type": "trainer_models.Outer", "model.parallel_modules": [
        {"type": "trainer_models.Inner", "forward_args_gen_fn": "trainer_models.mlp_forward_args",
         "compute_config": {"use_zero": "3"}}]}))
    assert a.model.parallel_modules[0].compute_config.use_zero == 3
    e = error_of(base(**{"compute_config.use_zero": 2}))
    assert e.key == "compute_config" and "True/1" in str(e) and "or 3" in str(e), str(e)
    # pipelines shard each stage's parameters: accepted
    TrainerArgs.from_dict(base(**{"compute_config.use_zero": 3, "pas_policy": "pp", "compute_config.plan_ngpus": 2,
                                  "compute_config.runtime_ngpus": 4})).validate()


@pytest.mark.parametrize("over, want", [
    ({"pas_policy": "pp", "compute_config.plan_ngpus": 2, "grad_accumulation_steps": 3}, 3),
    ({"pas_policy": "cp", "compute_config.plan_ngpus": 2, "compute_config.pas_config": {"pp_size": 2}}, 1),
    ({"pas_policy": "cp", "compute_config.plan_ngpus": 2}, None),  # no pipeline: nothing to set
    ({"pas_policy": "tp", "compute_config.plan_ngpus": 2}, None),
    ({"pas_policy": "dp"}, None),
])
def test_a_pipeline_runs_the_steps_micro_batches_unless_told(over, want):
    """Without pas_config.pipeline_nmicros a pipelining plan runs the step's micro-batches
    (grad_accumulation_steps), which is the only value the Trainer accepts."""
    a = TrainerArgs.from_dict(base(**{"compute_config.runtime_ngpus": 2, **over}))
    assert a.compute_config.pas_config.get("pipeline_nmicros") == want


def test_pas_config_values_from_the_command_line_are_read_as_values(tmp_path):
    """``--compute_config.pas_config.k V`` arrives as a string: it is read as YAML would read V
    (an int, a bool, a list), so `zero3_reshard_after_forward 2` is the int 2; names stay names."""
    import yaml
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(base(**{"compute_config.use_zero": 3, "compute_config.runtime_ngpus": 4})))
    argv = ["-f", str(path), "--compute_config.pas_config.zero3_reshard_after_forward", "2",
            "--compute_config.pas_config.recompute_modules", "LlamaDecoderLayer",
            "--compute_config.pas_config.zero3_units", "['model.layers.*']"]
    pas = TrainerArgs.from_argv(argv).compute_config.pas_config
    assert pas == {"zero3_reshard_after_forward": 2, "recompute_modules": "LlamaDecoderLayer",
                   "zero3_units": ["model.layers.*"]}, pas
    pas = TrainerArgs.from_argv(["-f", str(path), "--compute_config.pas_config.zero3_reshard_after_forward",
                                 "false"]).compute_config.pas_config
    assert pas["zero3_reshard_after_forward"] is False


@pytest.mark.parametrize("over, key, words", [
    # a typo: refused before any worker starts, naming the closest valid argument
    ({"model.args": {"nlayr": 3}}, "model.args.nlayr", "MLP has no argument 'nlayr'; did you mean 'nlayers'?"),
    # a value the annotation contradicts, as the command line gives it (a string)
    ({"model.args": {"nlayers": "three"}}, "model.args.nlayers", "expects int for 'nlayers' (its annotation), "
                                                                 "got 'three'"),
    ({"model.args": {"dropout": True}}, "model.args.dropout", "expects float"),
    ({"model.args": {"dim": 1.5}}, "model.args.dim", "expects int"),
    ({"model.parallel_modules": [{"type": "trainer_models.Inner", "args": {"dimm": 8},
                                  "forward_args_gen_fn": "trainer_models.mlp_forward_args"}],
      "model.type": "trainer_models.Outer"}, "model.parallel_modules.0.args.dimm", "did you mean 'dim'?"),
    ({"model.type": "trainer_models.NeedsArgs"}, "model.args", "needs the argument width: set model.args.width"),
])
def test_model_arguments_are_checked_against_the_signature(over, key, words):
    e = error_of(base(**over))
    assert e.key == key, str(e)
    assert words in str(e), str(e)


def test_model_arguments_that_fit_the_signature_pass():
    TrainerArgs.from_dict(base(**{"model.args": {"dim": "8", "nlayers": 3, "dropout": 0}}))  # '8' reads as 8; int for float
    TrainerArgs.from_dict(base(**{"model.type": "trainer_models.NeedsArgs",  # Optional, **kwargs takes anything
                                  "model.args": {"width": 4, "scale": None, "anything": [1]}}))
    TrainerArgs.from_dict(base(**{"model.args": {"dim": {"__value_type": "int", "value": "8"}}}))


def test_parallel_module_type_the_model_does_not_contain_is_refused_before_any_worker():
    # a real class, but MLP has no Inner: seen on the model built on the meta device
    e = error_of(base(**{"model.parallel_modules": [
        {"type": "trainer_models.Inner", "forward_args_gen_fn": "trainer_models.mlp_forward_args"}]}))
    assert e.key == "model.parallel_modules.0.type", str(e)
    assert "trainer_models.MLP has no sub-module of type 'trainer_models.Inner'" in str(e), str(e)
    assert "Linear" in str(e), str(e)  # the types it has
    TrainerArgs.from_dict(base(**{"model.type": "trainer_models.Outer", "model.parallel_modules": [
        {"type": "trainer_models.Inner", "forward_args_gen_fn": "trainer_models.mlp_forward_args"}]}))
