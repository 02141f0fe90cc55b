"""Lightning's private names are used in one place: nnscaler/lightning/internals.py, whose
docstring says why each is needed and which versions it was checked against."""
from __future__ import annotations

import ast
from pathlib import Path

import nnscaler.lightning
from nnscaler.lightning import internals

PACKAGE = Path(nnscaler.lightning.__file__).parent


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def lightning_private_uses(source: str) -> list:
    """(line, what) for each private name of Lightning `source` imports, and each read of a
    Lightning-private attribute this package is known to need (``_data_source``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ("lightning", "pytorch_lightning"):
            if any(_private(p) for p in node.module.split(".")):
                found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names if _private(a.name)]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names
                      if a.name.split(".")[0] == "lightning" and any(_private(p) for p in a.name.split("."))]
        elif isinstance(node, ast.Attribute) and node.attr == "_data_source":
            found.append((node.lineno, "._data_source"))
        elif isinstance(node, ast.Constant) and node.value == "_data_source":
            found.append((node.lineno, "'_data_source'"))
    return found


def test_the_checker_sees_private_lightning_names():
    source = ("from lightning.fabric.utilities.distributed import _sync_ddp_if_available\n"
              "import lightning.pytorch.trainer.connectors._x\n"
              "def f(trainer):\n    return trainer.fit_loop._data_source, getattr(trainer, '_data_source')\n")
    assert [line for line, _ in lightning_private_uses(source)] == [1, 2, 4, 4]


def test_only_internals_uses_lightnings_private_names():
    uses = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "internals.py" and path.parent == PACKAGE:
            continue
        found = lightning_private_uses(path.read_text())
        if found:
            uses[str(path.relative_to(PACKAGE))] = found
    assert not uses, f"use nnscaler.lightning.internals (and say why there): {uses}"


def test_internals_documents_each_name_and_the_versions():
    doc = internals.__doc__
    assert "Lightning 2.6.6" in doc and "torch 2.13.0" in doc
    for name in ("_SubprocessScriptLauncher", "_MultiProcessingLauncher", "_init_dist_connection",
                 "_get_default_process_group_backend_for_device", "_distributed_is_initialized",
                 "_sync_ddp_if_available", "_init_optimizers_and_lr_schedulers", "_BackwardSyncControl",
                 "_data_source"):
        assert name in doc, name
    assert lightning_private_uses((PACKAGE / "internals.py").read_text())  # they are all here
