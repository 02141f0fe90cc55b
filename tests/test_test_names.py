"""pytest imports a test module under its file name alone when its folder is not a package (no
`__init__.py`), with the package's dotted name otherwise; two modules with the same import name
in different folders break collection of the second ("import file mismatch") in whichever tier
meets it first. Every import name under tests/ is therefore unique (conftest.py aside: pytest
loads each one by path)."""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _import_name(path: Path) -> str:
    parts, folder = [path.stem], path.parent
    while (folder / "__init__.py").exists():
        parts.insert(0, folder.name)
        folder = folder.parent
    return ".".join(parts)


def test_every_module_name_under_tests_is_unique():
    seen = defaultdict(list)
    for path in TESTS.rglob("*.py"):
        if path.name not in ("conftest.py", "__init__.py") and "__pycache__" not in path.parts:
            seen[_import_name(path)].append(str(path.relative_to(TESTS)))
    clashes = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not clashes, f"rename one of each: {clashes}"
