"""The ``nnscaler`` command itself: help, version, start-up cost."""
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from typer.testing import CliRunner

from nnscaler.cli.main import app

from .conftest import run_cli

runner = CliRunner()


def test_help_lists_builtin_commands():
    result = runner.invoke(app, ["--help"], prog_name="nnscaler")
    assert result.exit_code == 0, result.output
    assert "Usage: nnscaler" in result.output
    assert "info" in result.output
    assert "--version" in result.output


def test_short_help_option():
    result = runner.invoke(app, ["-h"])
    assert result.exit_code == 0
    assert "info" in result.output


def test_no_arguments_prints_help():
    result = runner.invoke(app, [])
    assert "Usage:" in result.output
    assert "info" in result.output


def test_version_is_the_installed_distribution_version():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.output.strip() == f"nnscaler-cli {metadata.version('nnscaler-cli')}"


def test_unknown_command_fails():
    result = runner.invoke(app, ["no-such-command"])
    assert result.exit_code != 0
    assert "No such command" in result.output


@pytest.mark.multiprocess  # a fresh interpreter
def test_help_does_not_import_torch():
    code = (
        "import sys\n"
        "import nnscaler.cli.main as m\n"
        "try:\n"
        "    m.app(['--help'], prog_name='nnscaler')\n"
        "except SystemExit as e:\n"
        "    assert e.code in (0, None), e.code\n"
        "heavy = sorted(n for n in ('torch', 'numpy') if n in sys.modules)\n"
        "print('IMPORTED', heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert "IMPORTED []" in out.stdout


@pytest.mark.multiprocess  # a fresh interpreter
def test_help_does_not_import_plugins(plugin_path):
    # The heavy plug-in imports torch at module level; listing it must not load it.
    code = (
        "import sys\n"
        "import nnscaler.cli.main as m\n"
        "try:\n"
        "    m.app(['--help'], prog_name='nnscaler')\n"
        "except SystemExit:\n"
        "    pass\n"
        "print('LOADED', sorted(n for n in sys.modules if n.startswith(('torch', 'nnscaler_test'))))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(plugin_path), COLUMNS="200")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert "heavy" in out.stdout
    assert "LOADED []" in out.stdout


@pytest.mark.multiprocess  # a fresh interpreter
def test_console_script_is_installed():
    script = Path(sys.executable).with_name("nnscaler")
    assert script.exists(), f"{script} missing: run bash tools/install.sh"
    out = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("nnscaler-cli ")


@pytest.mark.multiprocess  # a fresh interpreter
def test_python_dash_m():
    out = run_cli("--help")
    assert out.returncode == 0, out.stderr
    assert "Usage: nnscaler" in out.stdout
