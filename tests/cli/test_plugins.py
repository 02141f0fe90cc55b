"""Sub-commands found through the entry-point group ``nnscaler.commands``, with real
(temporary) installed distributions, run in fresh interpreters."""
import pytest
from typer.testing import CliRunner

from nnscaler.cli import ENTRY_POINT_GROUP
from nnscaler.cli.main import app
from nnscaler.cli.plugins import PANEL, discover, load_error

from .conftest import GREET_MODULE, run_cli, write_dist


@pytest.mark.multiprocess  # a fresh interpreter
def test_help_lists_plugins_without_loading_them(plugin_path):
    out = run_cli("--help", pythonpath=plugin_path)
    assert out.returncode == 0, out.stderr
    assert PANEL in out.stdout
    for name in ("greet", "shout", "broken", "heavy", "info"):
        assert name in out.stdout
    assert "Greetings from a test plug-in." in out.stdout
    # The broken plug-in is listed, not reported: nothing was loaded.
    assert "could not be loaded" not in out.stdout + out.stderr


@pytest.mark.multiprocess  # a fresh interpreter
def test_typer_plugin_becomes_a_group(plugin_path):
    out = run_cli("greet", "--help", pythonpath=plugin_path)
    assert out.returncode == 0, out.stderr
    assert "hello" in out.stdout and "bye" in out.stdout
    out = run_cli("greet", "hello", "--name", "Ada", pythonpath=plugin_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "hello Ada"
    out = run_cli("greet", pythonpath=plugin_path)  # no sub-command: the group's help
    assert "hello" in out.stdout and "Greetings from a test plug-in." in out.stdout


@pytest.mark.multiprocess  # a fresh interpreter
def test_function_plugin_becomes_a_command(plugin_path):
    out = run_cli("shout", "hi", pythonpath=plugin_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "HI"


@pytest.mark.multiprocess  # a fresh interpreter
def test_plugin_that_imports_torch_runs(plugin_path):
    out = run_cli("heavy", pythonpath=plugin_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("torch ")


@pytest.mark.multiprocess  # a fresh interpreter
@pytest.mark.parametrize("args", [["broken"], ["broken", "--help"], ["broken", "x", "--y"]])
def test_broken_plugin_is_reported_when_run(plugin_path, args):
    out = run_cli(*args, pythonpath=plugin_path)
    assert out.returncode == 1
    assert "Traceback" not in out.stderr
    assert "the command 'broken' could not be loaded" in out.stderr
    assert "broken = nnscaler_no_such_module:app" in out.stderr
    assert "nnscaler-test-broken 0.1" in out.stderr
    assert "ModuleNotFoundError" in out.stderr


@pytest.mark.multiprocess  # a fresh interpreter
def test_plugin_of_wrong_type_is_reported(plugin_path):
    out = run_cli("notacommand", pythonpath=plugin_path)
    assert out.returncode == 1
    assert "expected a typer.Typer or a function" in out.stderr


@pytest.mark.multiprocess  # a fresh interpreter
def test_builtin_command_wins_over_plugin(plugin_path):
    out = run_cli("info", pythonpath=plugin_path)
    assert out.returncode == 0, out.stderr
    assert "nnscaler distributions" in out.stdout
    # info reports every plug-in and whether it loads.
    table = out.stdout[out.stdout.index("plug-in commands"):]
    rows = {line.split()[1]: line for line in table.splitlines()
            if line.startswith("│") and len(line.split()) > 1}
    assert "ok" in rows["greet"]
    assert "hidden by the built-in command" in rows["info"]
    assert "ModuleNotFoundError" in rows["broken"]


def test_first_distribution_on_sys_path_wins(tmp_path, monkeypatch):
    first, second = tmp_path / "first", tmp_path / "second"
    write_dist(first, "nnscaler-test-first", {"dup": "nnscaler_test_first:shout"},
               {"nnscaler_test_first": GREET_MODULE})
    write_dist(second, "nnscaler-test-second", {"dup": "nnscaler_test_first:shout"})
    monkeypatch.syspath_prepend(str(second))
    monkeypatch.syspath_prepend(str(first))
    found = [p for p in discover(reserved={"info"}) if p.name == "dup"]
    assert [p.distribution for p in found] == ["nnscaler-test-first 0.1",
                                               "nnscaler-test-second 0.1"]
    assert found[0].shadowed_by is None
    assert "nnscaler-test-first" in found[1].shadowed_by
    assert load_error(found[0]) is None

    result = CliRunner().invoke(app, ["dup", "quiet"])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == "QUIET"


def test_entry_point_group_name():
    assert ENTRY_POINT_GROUP == "nnscaler.commands"
