"""Command-line overrides, ${...} references and YAML loading."""
from __future__ import annotations

import pytest

from nnscaler.trainer import TrainerArgs, TrainerConfigError
from nnscaler.trainer.config.loading import load_config
from nnscaler.trainer.config.overrides import apply_overrides, parse_overrides
from nnscaler.trainer.config.references import resolve_references
from nnscaler.trainer.config.values import build_args

YAML = """
vars: {dim: 8, lr: 0.5}
compute_config: {plan_ngpus: 1, runtime_ngpus: 1, use_end2end: true}
pas_policy: dp
seed: 0
max_epochs: 2
model: {type: trainer_models.MLP, args: {dim: "${vars.dim}"}}
optimizer: {type: torch.optim.SGD, args: {lr: "${vars.lr}"}}
dataset: {type: trainer_models.RandomDataset, train_args: {dim: "${model.args.dim}"}}
checkpoint: {save_dir: "${env.TRAINER_TEST_DIR}/ckpt"}
log:
  - {type: nnscaler.trainer.TensorBoardLogger, args: {root_dir: tb}}
"""


@pytest.fixture
def cfg(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINER_TEST_DIR", str(tmp_path))
    path = tmp_path / "cfg.yaml"
    path.write_text(YAML)
    return str(path)


def test_parse_override_forms():
    assert parse_overrides(["--a.b", "1", "--c=x=y", "--d!", "--flag", "--e", "-3"]) == \
        [("a.b", "1"), ("c", "x=y"), ("d", parse_overrides(["--d!"])[0][1]), ("flag", "true"), ("e", "-3")]
    with pytest.raises(TrainerConfigError, match="unexpected argument 'oops'"):
        parse_overrides(["oops"])


def test_apply_overrides_lists_create_and_remove():
    data = {"log": [{"type": "A"}], "x": {"y": 1}}
    out = apply_overrides(data, ["--log.0.type", "B", "--log.1.type=C", "--x.y!", "--new.list.0", "7"])
    assert out == {"log": [{"type": "B"}, {"type": "C"}], "x": {}, "new": {"list": ["7"]}}
    assert data["log"][0]["type"] == "A"  # not changed in place
    with pytest.raises(TrainerConfigError, match="past the end"):
        apply_overrides(data, ["--log.5.type", "X"])
    with pytest.raises(TrainerConfigError, match="no key 'z' to remove"):
        apply_overrides(data, ["--x.z!"])


def test_references_keys_env_and_cycles(monkeypatch):
    monkeypatch.setenv("TRAINER_X", "hello")
    out = resolve_references({"a": 3, "b": "${a}", "c": "n=${b}", "d": "${env.TRAINER_X}", "e": ["${a}"]})
    assert out == {"a": 3, "b": 3, "c": "n=3", "d": "hello", "e": [3]}
    with pytest.raises(TrainerConfigError, match="reference cycle: a -> b -> a"):
        resolve_references({"a": "${b}", "b": "${a}"})
    with pytest.raises(TrainerConfigError, match="does not exist"):
        resolve_references({"a": "${nope.x}"})
    with pytest.raises(TrainerConfigError, match="'TRAINER_UNSET_VAR' is not set"):
        resolve_references({"a": "${env.TRAINER_UNSET_VAR}"})


def test_yaml_with_overrides_and_references(cfg, tmp_path):
    a = TrainerArgs.from_yaml(cfg, ["--max_epochs", "3", "--vars.dim=4", "--log.0.args.root_dir", "other",
                                    "--checkpoint.save_dir!"])
    assert a.max_epochs == 3 and a.model.args["dim"] == 4  # typed as it will be built (and printed)
    assert build_args(a.model.args, "model.args") == {"dim": 4} and a.dataset.train_args["dim"] == 4
    assert a.optimizer.args["lr"] == 0.5 and a.log[0].args["root_dir"] == "other"
    assert a.checkpoint.save_dir == "./checkpoints"  # removed: back to the default
    assert load_config(cfg, [])["checkpoint"]["save_dir"] == f"{tmp_path}/ckpt"


def test_bad_override_values_name_the_key(cfg):
    with pytest.raises(TrainerConfigError, match="^max_epochs: expected an integer"):
        TrainerArgs.from_yaml(cfg, ["--max_epochs", "two"])
    with pytest.raises(TrainerConfigError, match="^model: unknown key 'tpye'; did you mean 'type'"):
        TrainerArgs.from_yaml(cfg, ["--model.tpye", "x"])


def test_missing_and_invalid_yaml(tmp_path):
    with pytest.raises(TrainerConfigError, match="does not exist"):
        load_config(str(tmp_path / "none.yaml"), [])
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [1,\n")
    with pytest.raises(TrainerConfigError, match="not valid YAML"):
        load_config(str(bad), [])
