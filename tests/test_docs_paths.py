"""Every file path docs/architecture.md names exists in the repository.

What counts as a path (read from code spans ``like/this.py`` and link targets ``](x.md)``):
- a span of path characters only (letters, digits, ``_ . / -``): no spaces, and no placeholder
  (``<part>``, ``{rank}``, ``*``, ``…``), so ``packages/<dist>/src/...`` is a pattern, not checked;
- with a ``/``: its last part ends in a file suffix (``.py``, ``.md``, ``.json``, ...), or it ends
  in ``/`` (a folder), or it starts with a top-level folder of the repository (``packages/``,
  ``tests/``, ``bench/``, ``tools/``, ``docs/``, ``examples/``). ``ir/user_code.warn_user`` (a
  function) and ``1/z`` (arithmetic) are not paths;
- without a ``/``: a source or document file name (``.py``, ``.md``, ``.sh``, ``.toml``, ``.rst``).
  A bare data file name (``graph.json``, ``train_config.yaml``) is what a run writes, not checked.

Where a path is looked up: from the repository root, docs/ (links), each ``packages/<dist>/``
(``src/nnscaler/...``), each ``packages/<dist>/src/nnscaler/`` (module paths as the doc writes
them: ``runtime/grid.py``) and each package's own folder (``tracer/`` in the ir section); the
umbrella's ``src/``. A bare file name exists when some file of the repository has that name.
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
TOP = ("packages/", "tests/", "bench/", "tools/", "docs/", "examples/")
SUFFIXES = (".py", ".md", ".sh", ".toml", ".rst", ".txt", ".json", ".yaml", ".yml", ".cfg", ".ini")
BARE_SUFFIXES = (".py", ".md", ".sh", ".toml", ".rst")
_PATH_CHARS = re.compile(r"[\w./-]+")


def named_paths(text: str) -> list[tuple[int, str]]:
    """``(line, path)`` for each path ``text`` names, by the rule of this module's docstring."""
    found = [(m.start(), m.group(1)) for m in re.finditer(r"`([^`\n]+)`", text)]
    found += [(m.start(), m.group(1)) for m in re.finditer(r"\]\(([^)\s#]+)", text)]
    out = []
    for start, span in sorted(found):
        if not _PATH_CHARS.fullmatch(span) or span.startswith(("/", ".")) or "://" in span:
            continue
        if "/" in span:
            last = span.rstrip("/").rsplit("/", 1)[-1]
            if not (last.endswith(SUFFIXES) or span.endswith("/") or span.startswith(TOP)):
                continue
        elif not span.endswith(BARE_SUFFIXES):
            continue
        out.append((text.count("\n", 0, start) + 1, span))
    return out


def _bases(root: Path) -> list[Path]:
    return [root, root / "docs", root / "src", *sorted(root.glob("packages/*")),
            *sorted(root.glob("packages/*/src/nnscaler")), *sorted(root.glob("packages/*/src/nnscaler/*"))]


def _file_names(root: Path) -> set[str]:
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=root,
                            capture_output=True, text=True, check=True).stdout.split()
    return {Path(p).name for p in listed}


def missing(paths: list[tuple[int, str]], root: Path, names: set[str]) -> list[str]:
    bases = _bases(root)
    out = []
    for line, path in paths:
        exists = any((b / path).exists() for b in bases) if "/" in path else path in names
        if not exists:
            out.append(f"docs/architecture.md:{line}: `{path}`")
    return out


def test_every_path_the_architecture_doc_names_exists():
    paths = named_paths(DOC.read_text(encoding="utf-8"))
    assert len(paths) > 50, "the doc names far fewer paths than it does: is the rule broken?"
    bad = missing(paths, ROOT, _file_names(ROOT))
    assert not bad, ("docs/architecture.md names files that do not exist; fix the path (or say it in "
                     "words):\n  " + "\n  ".join(bad))


# ------------------------------------------------------------------- the checker can fail


@pytest.mark.parametrize("text, expected", [
    ("see `runtime/precision.py` here", ["runtime/precision.py"]),
    ("the brief is `DESIGN.md`", ["DESIGN.md"]),
    ("[guide](pipeline.md#top)", ["pipeline.md"]),
    ("`tests/ir/`", ["tests/ir/"]),
    ("`packages/nnscaler-ir`", ["packages/nnscaler-ir"]),
    ("`ir/user_code.warn_user`, `1/z`, `graph.json`, `nnscaler.ir`", []),
    ("`packages/<dist>/src/x.py`, `gencode{rank}.py`, `-e packages/a … -e .`", []),
])
def test_what_counts_as_a_path(text, expected):
    assert [p for _, p in named_paths(text)] == expected


def test_a_missing_path_is_reported_with_its_line(tmp_path):
    (tmp_path / "packages" / "nnscaler-x" / "src" / "nnscaler" / "x").mkdir(parents=True)
    (tmp_path / "packages" / "nnscaler-x" / "src" / "nnscaler" / "x" / "here.py").write_text("")
    text = "`x/here.py`\n`x/gone.py` and `Gone.md`\n`here.py`"
    assert missing(named_paths(text), tmp_path, {"here.py"}) == [
        "docs/architecture.md:2: `x/gone.py`", "docs/architecture.md:2: `Gone.md`"]
