"""Helpers for the CLI tests: run ``nnscaler`` in a fresh interpreter and fake installed
plug-in distributions (a ``*.dist-info`` directory on a temporary ``sys.path`` entry)."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest


def run_cli(*args, pythonpath=None, timeout=120):
    """``python -m nnscaler.cli ARGS`` in a fresh interpreter; extra ``sys.path`` entries first."""
    env = dict(os.environ, COLUMNS="200", NO_COLOR="1", TERM="dumb")
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(
            [str(pythonpath), *filter(None, [os.environ.get("PYTHONPATH")])])
    return subprocess.run([sys.executable, "-m", "nnscaler.cli", *args], env=env,
                          capture_output=True, text=True, timeout=timeout)


def write_dist(root: Path, name: str, entry_points: dict, modules: dict = (),
               summary: str = "A plug-in for tests.") -> Path:
    """A minimal installed distribution: METADATA and entry_points.txt under
    ``root/<name>-0.1.dist-info``, plus ``root/<module>.py`` for each module source given."""
    info = root / f"{name.replace('-', '_')}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\nSummary: {summary}\n")
    lines = ["[nnscaler.commands]", *(f"{k} = {v}" for k, v in entry_points.items())]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    for module, source in dict(modules).items():
        (root / f"{module}.py").write_text(textwrap.dedent(source))
    return root


GREET_MODULE = """
    import typer

    app = typer.Typer()

    @app.command()
    def hello(name: str = "world"):
        \"\"\"Say hello.\"\"\"
        print(f"hello {name}")

    @app.command()
    def bye():
        \"\"\"Say goodbye.\"\"\"
        print("bye")

    def shout(word: str):
        \"\"\"Shout a word.\"\"\"
        print(word.upper())

    NOT_A_COMMAND = 42
"""


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory):
    """A sys.path entry holding three plug-in distributions: a working one, a broken one, and
    one whose module imports torch at import time."""
    root = tmp_path_factory.mktemp("plugins")
    write_dist(root, "nnscaler-test-greet", {
        "greet": "nnscaler_test_greet:app",
        "shout": "nnscaler_test_greet:shout",
        "info": "nnscaler_test_greet:shout",
        "notacommand": "nnscaler_test_greet:NOT_A_COMMAND",
    }, {"nnscaler_test_greet": GREET_MODULE}, summary="Greetings from a test plug-in.")
    write_dist(root, "nnscaler-test-broken", {"broken": "nnscaler_no_such_module:app"},
               summary="A plug-in whose module is missing.")
    write_dist(root, "nnscaler-test-heavy", {"heavy": "nnscaler_test_heavy:main"}, {
        "nnscaler_test_heavy": """
            import torch

            def main():
                \"\"\"Print the torch version.\"\"\"
                print("torch", torch.__version__)
        """}, summary="A plug-in that imports torch.")
    return root
