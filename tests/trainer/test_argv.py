"""The command line as the config layer reads it (`TrainerArgs.from_argv`, config/argv.py); the
CLI depends on the Trainer, never the other way."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import yaml

import nnscaler.trainer
from nnscaler.trainer import TrainerArgs, TrainerConfigError
from nnscaler.trainer.config.argv import split_argv

from loop_helpers import config

PACKAGE = Path(nnscaler.trainer.__file__).parent


def write_config(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(config(tmp_path)))
    return str(path)


def test_from_argv_reads_the_config_and_overrides_and_leaves_the_launcher_options(tmp_path):
    cfg = write_config(tmp_path)
    args = TrainerArgs.from_argv(["-f", cfg, "--nproc", "1", "--print-config", "--max_train_steps", "3"])
    assert args.max_train_steps == 3 and args.run_mode == "run"
    assert TrainerArgs.from_argv([f"--config={cfg}"], run_mode="compile").run_mode == "compile"
    line = split_argv(["-f", cfg, "--nproc=2", "--print-config", "--seed", "1"])
    assert (line.config, line.nproc, line.print_config, line.overrides) == (cfg, 2, True, ["--seed", "1"])


@pytest.mark.parametrize("argv, words", [([], "no config file: pass -f CONFIG.yaml"),
                                         (["-f"], "-f needs a value"),
                                         (["-f", "x.yaml", "--nproc", "0"], "--nproc must be a positive integer")])
def test_bad_command_lines_say_the_fix(argv, words):
    with pytest.raises(TrainerConfigError, match=words):
        TrainerArgs.from_argv(argv)


def test_only_the_cli_imports_the_cli():
    """The CLI builds on the Trainer and its config; nothing outside cli/ imports it."""
    importers = []
    for path in PACKAGE.rglob("*.py"):
        if "cli" in path.relative_to(PACKAGE).parts[:-1] or path.name == "__main__.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [a.name for a in node.names]
                if any("cli" in n.split(".") for n in names):
                    importers.append(str(path.relative_to(PACKAGE)))
    assert importers == []
