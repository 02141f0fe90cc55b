"""Package dependencies point one way (docs/architecture.md, "Dependency rules").

Four checks, each able to fail on its own:
- the import graph: every ``.py`` file of a part is parsed with ``ast`` and each import of
  another part must be allowed by ``ALLOWED`` (module level) or ``LAZY_ALLOWED`` (inside a
  function body or an ``if TYPE_CHECKING:`` block only);
- private names stay in their part: no part imports another part's ``_name`` (a function, a
  module), reads ``alias._name`` of another part's module or class, or reads a private attribute
  that only another part sets (``optimizer._nnscaler_zero`` set by the runtime); see
  `private_access` and its allow-list ``FOREIGN_PRIVATE``;
- the declared dependencies: each part's ``pyproject.toml`` names only allowed parts, and
  installs every part it imports;
- the real import: each part imports in a fresh interpreter and loads no part it may not use.
"""
from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from packaging.requirements import Requirement  # pytest depends on packaging

try:
    import tomllib
except ImportError:  # Python 3.10: pytest depends on tomli there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("ir", "policies", "codegen", "runtime", "ckpt", "trainer", "lightning", "cli")
_ABOVE_RUNTIME = {"runtime", "ir", "policies", "codegen", "ckpt"}

# The parts each part may import at module level (DESIGN "Packages" table, made transitive).
ALLOWED: dict[str, set[str]] = {
    "ir": set(),
    "policies": {"ir"},
    "codegen": {"ir"},
    "runtime": {"ir"},
    "ckpt": {"ir"},
    "trainer": _ABOVE_RUNTIME,
    "lightning": _ABOVE_RUNTIME,
    "cli": set(),  # finds the other packages through entry points only
}
# Parts that may be imported only when needed (inside functions): runtime's `compile` extra.
LAZY_ALLOWED: dict[str, set[str]] = {"runtime": {"policies", "codegen"}}
UMBRELLA = "nnscaler (the umbrella package's re-exports)"
# What another part may import of a part: its package (``__init__`` exports what others use) and
# these public sub-packages; its other modules are private to it.
PUBLIC_MODULES: dict[str, set[str]] = {part: {f"nnscaler.{part}"} for part in PARTS}
PUBLIC_MODULES["ir"] |= {"nnscaler.ir.contracts", "nnscaler.ir.schedules"}


def part_dir(part: str) -> Path:
    return ROOT / "packages" / f"nnscaler-{part}"


# --------------------------------------------------------------------------- the checker


@dataclasses.dataclass(frozen=True)
class Import:
    target: str  # a part name, or UMBRELLA for `from nnscaler import <not a part>`
    line: int
    lazy: bool  # inside a function body or an `if TYPE_CHECKING:` block
    module: str = ""  # the module imported (``nnscaler.ir.graph``)


def _target(module: str, names: list[str]) -> list[str]:
    """The parts a `from <module> import <names>` (or `import <module>`) reaches."""
    pieces = module.split(".")
    if pieces[0] != "nnscaler":
        return []
    if len(pieces) > 1:
        return [pieces[1]]
    # `from nnscaler import x`: a part, or an attribute of the umbrella package.
    # (`import nnscaler` alone, names == [], is the parent package every part already has.)
    return [name if name in PARTS else UMBRELLA for name in names]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _dynamic_import(node: ast.Call) -> str | None:
    """The module of `importlib.import_module("nnscaler.x")` / `__import__("nnscaler.x")`."""
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    if name in ("import_module", "__import__") and node.args:
        arg = node.args[0]
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            return arg.value
    return None


def nnscaler_imports(source: str, package: str, filename: str = "<string>") -> list[Import]:
    """Every reference to an nnscaler package in ``source``, a module of ``package``
    (``nnscaler.ir`` for ``nnscaler/ir/x.py`` and for ``nnscaler/ir/__init__.py``)."""
    found: list[Import] = []

    def visit(node: ast.AST, lazy: bool) -> None:
        targets: list[str] = []
        if isinstance(node, ast.Import):
            for alias in node.names:
                targets += _target(alias.name, [])
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = package.split(".")
                if node.level - 1 >= len(base):
                    raise ValueError(f"{filename}:{node.lineno}: relative import beyond the top")
                base = base[:len(base) - (node.level - 1)]
                module = ".".join(base + ([module] if module else []))
            targets += _target(module, [alias.name for alias in node.names])
        elif isinstance(node, ast.Call):
            module = _dynamic_import(node)
            if module:
                targets += _target(module, [])
        imported = ""
        if isinstance(node, ast.ImportFrom):
            imported = module
        elif isinstance(node, ast.Import) and node.names:
            imported = node.names[0].name
        found.extend(Import(t, node.lineno, lazy, imported) for t in targets)

        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            for child in ast.iter_child_nodes(node):
                # decorators and defaults run at definition time, the body does not
                is_body = child not in getattr(node, "decorator_list", []) and not (
                    isinstance(child, ast.arguments))
                visit(child, lazy or is_body)
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, True)
            for child in node.orelse:
                visit(child, lazy)
        else:
            for child in ast.iter_child_nodes(node):
                visit(child, lazy)

    visit(ast.parse(source, filename), False)
    return found


def violations(part: str, source: str, package: str, filename: str = "<string>") -> list[str]:
    """Messages for each import in ``source`` that breaks the rules for ``part``."""
    out = []
    for imp in nnscaler_imports(source, package, filename):
        if imp.target in PARTS and imp.target != part and imp.module.startswith(f"nnscaler.{imp.target}.") \
                and imp.module not in PUBLIC_MODULES[imp.target]:
            out.append(f"{filename}:{imp.line}: nnscaler.{part} imports {imp.module}, a private module of "
                       f"nnscaler.{imp.target}; import from "
                       f"{' or '.join(sorted(PUBLIC_MODULES[imp.target]))} (export the name there if needed)")
            continue
        if imp.target == part or imp.target in ALLOWED[part]:
            continue
        if imp.lazy and imp.target in LAZY_ALLOWED.get(part, set()):
            continue
        where = f"{filename}:{imp.line}"
        if imp.target == UMBRELLA:
            out.append(f"{where}: nnscaler.{part} imports from the umbrella package `nnscaler`, "
                       "which depends on every part; import from nnscaler.<part> instead")
        elif imp.target in LAZY_ALLOWED.get(part, set()):
            out.append(f"{where}: nnscaler.{part} imports nnscaler.{imp.target} at module "
                       "level; it is an optional extra, import it inside the function using it")
        else:
            allowed = sorted(ALLOWED[part]) or "no other part"
            out.append(f"{where}: nnscaler.{part} imports nnscaler.{imp.target}; "
                       f"it may import {allowed}")
    return out


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _string_arg(node: ast.Call, i: int) -> str | None:
    arg = node.args[i] if len(node.args) > i else None
    return arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else None


def private_attributes(source: str) -> tuple[set[str], list[tuple[str, int]]]:
    """(private attribute names ``source`` sets: ``x._a = ...``, ``setattr(x, "_a", ...)``,
    ``x.__dict__["_a"] = ...``, private methods and class attributes; (name, line) of each private
    attribute it reads: ``x._a``, ``getattr(x, "_a")``, ``x.__dict__["_a"]``)."""
    sets, reads = set(), []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            if isinstance(node.ctx, (ast.Store, ast.Del)):
                sets.add(node.attr)
            else:
                reads.append((node.attr, node.lineno))
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr", "setattr"):
            name = _string_arg(node, 1)
            if name and _private(name):
                (sets.add(name) if node.func.id == "setattr" else reads.append((name, node.lineno)))
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) \
                and node.value.attr == "__dict__" and isinstance(node.slice, ast.Constant) \
                and isinstance(node.slice.value, str) and _private(node.slice.value):
            (sets.add(node.slice.value) if isinstance(node.ctx, ast.Store) else reads.append((node.slice.value, node.lineno)))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _private(node.name):
            sets.add(node.name)
        elif isinstance(node, ast.ClassDef):
            for stmt in node.body:
                targets = stmt.targets if isinstance(stmt, ast.Assign) else \
                    [stmt.target] if isinstance(stmt, ast.AnnAssign) else []
                sets.update(t.id for t in targets if isinstance(t, ast.Name) and _private(t.id))
    return sets, reads


# Private attribute names set by one part and read by another that are not nnscaler's: each is
# the library's own member (or another object's), which both parts use independently.
FOREIGN_PRIVATE: dict[str, str] = {
    "_parameters": "torch.nn.Module's parameter dict (codegen and the runtime read the generated module's)",
    "_buffers": "torch.nn.Module's buffer dict",
    "_version": "torch.Tensor's in-place version counter",
    "_fields": "a NamedTuple's / dataclass-like field list",
    "_device": "unrelated objects of each part that keep a device",
    "_timeout": "torch's backend options (runtime) and Lightning's strategy attribute (lightning)",
    "_unscale_grads_": "torch.amp.GradScaler's method: runtime and lightning each subclass torch's scaler",
}


def _part_private_attributes() -> dict[str, tuple[set[str], list[tuple[str, str, int]]]]:
    out = {}
    for part in PARTS:
        sets, reads = set(), []
        for path, _ in part_sources(part):
            s, r = private_attributes(path.read_text())
            sets |= s
            reads += [(name, str(path.relative_to(ROOT)), line) for name, line in r]
        out[part] = (sets, reads)
    return out


def private_access(part: str, source: str, package: str, filename: str = "<string>",
                   others_set: dict[str, set[str]] | None = None) -> list[str]:
    """Messages for each use in ``source`` (a module of ``part``) of another part's private name:
    ``from nnscaler.x import _f`` or a module ``nnscaler.x._m``; ``alias._f`` where ``alias`` is
    another part's module or a name imported from it; ``nnscaler.x._f``; and, with
    ``others_set`` (part -> private attributes it sets), reading an attribute that another part
    sets and this one never does (unless `FOREIGN_PRIVATE` says it is not nnscaler's)."""
    out, aliases = [], {}
    tree = ast.parse(source, filename)
    own_sets, reads = private_attributes(source)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for imp in nnscaler_imports(ast.unparse(node), package):
                if imp.target not in PARTS or imp.target == part:
                    continue
                where = f"{filename}:{node.lineno}"
                if any(_private(piece) for piece in imp.module.split(".")):
                    out.append(f"{where}: nnscaler.{part} imports {imp.module}, a private module of nnscaler.{imp.target}")
                for alias in node.names:
                    if isinstance(node, ast.ImportFrom) and _private(alias.name):
                        out.append(f"{where}: nnscaler.{part} imports {alias.name} from {imp.module}, a private "
                                   f"name of nnscaler.{imp.target}; give it a public name there")
                    elif isinstance(node, ast.ImportFrom) or alias.asname:
                        aliases[alias.asname or alias.name] = imp.target
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            base, chain = node.value, []
            while isinstance(base, ast.Attribute):
                chain.append(base.attr)
                base = base.value
            if not isinstance(base, ast.Name):
                continue
            target = aliases.get(base.id)
            if base.id == "nnscaler" and chain and chain[-1] in PARTS:
                target = chain[-1]
            if target is not None and target != part:
                out.append(f"{filename}:{node.lineno}: nnscaler.{part} reads {ast.unparse(node)}, a private name of "
                           f"nnscaler.{target}; give it a public name there")
    for name, line in reads if others_set else ():
        owners = sorted(o for o, names in others_set.items() if o != part and name in names)
        if owners and name not in own_sets and name not in FOREIGN_PRIVATE:
            out.append(f"{filename}:{line}: nnscaler.{part} reads the private attribute {name}, which "
                       f"nnscaler.{'/'.join(owners)} sets; ask that part through a public function or property")
    return out


def part_sources(part: str):
    """``(path, package)`` for every module of a part."""
    src = part_dir(part) / "src"
    for path in sorted((src / "nnscaler" / part).rglob("*.py")):
        package_dir = path.parent
        yield path, ".".join(package_dir.relative_to(src).parts)


# ---------------------------------------------------------------- the checker can fail


def _check(part: str, source: str, package: str | None = None) -> list[str]:
    return violations(part, textwrap.dedent(source), package or f"nnscaler.{part}")


@pytest.mark.parametrize("part, source, package", [
    ("ir", "import nnscaler.runtime", None),
    ("ir", "import nnscaler.runtime.module as m", None),
    ("ir", "from nnscaler.runtime import ParallelModule", None),
    ("ir", "from nnscaler import runtime", None),
    ("ir", "from ...runtime import x", "nnscaler.ir.sub"),
    ("ir", "from .. import policies", "nnscaler.ir"),
    ("ir", "import importlib\nm = importlib.import_module('nnscaler.codegen')", None),
    ("policies", "from nnscaler.codegen import emit", None),
    ("codegen", "from nnscaler.policies import get_policy", None),
    ("runtime", "from nnscaler.policies import get_policy", None),
    ("runtime", "import nnscaler.codegen", None),
    ("runtime", "class A:\n    from nnscaler.codegen import emit", None),
    ("runtime", "@functools.wraps(importlib.import_module('nnscaler.codegen'))\n"
                "def f():\n    pass", None),
    ("runtime", "def f(x=__import__('nnscaler.policies')):\n    pass", None),
    ("runtime", "from nnscaler.trainer import Trainer", None),
    ("ckpt", "def f():\n    from nnscaler.runtime import x", None),
    ("trainer", "from nnscaler import parallelize", None),
    ("trainer", "from nnscaler.lightning import NnScalerStrategy", None),
    ("cli", "import nnscaler.ir", None),
    ("cli", "def f():\n    import nnscaler.trainer", None),
    ("policies", "from nnscaler.ir.graph import IRGraph", None),
    ("runtime", "def f():\n    from nnscaler.codegen.emit import emit_rank", None),
    ("ckpt", "import nnscaler.ir.layout", None),
])
def test_checker_reports_violations(part, source, package):
    assert _check(part, source, package), f"not caught in {part}: {source!r}"


@pytest.mark.parametrize("part, source, package", [
    ("ir", "from . import graph\nfrom .layout import Shard", None),
    ("ir", "from ..ir import graph", "nnscaler.ir"),
    ("ir", "from .. import layout", "nnscaler.ir.sub"),
    ("ir", "import nnscaler.ir.graph\nimport nnscaler\nimport torch", None),
    ("ir", "def f():\n    import nnscaler\n    return nnscaler.__path__", None),
    ("policies", "from nnscaler.ir import IRGraph\nfrom nnscaler.ir.contracts import Piece", None),
    ("runtime", "from nnscaler.ir.schedules import Action", None),
    ("runtime", "def compile():\n    import nnscaler.codegen\n"
                "    from nnscaler.policies import get_policy", None),
    ("runtime", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                "    from nnscaler.policies import Plan", None),
    ("runtime", "class A:\n    def f(self):\n        from nnscaler import codegen", None),
    ("trainer", "from nnscaler.runtime import parallelize\nfrom nnscaler.ckpt import save\n"
                "import nnscaler.policies", None),
    ("cli", "from importlib import metadata\nimport typer", None),
])
def test_checker_accepts_allowed_imports(part, source, package):
    assert _check(part, source, package) == []


@pytest.mark.parametrize("part, source", [
    ("lightning", "from nnscaler.runtime import _wait"),
    ("lightning", "from nnscaler.runtime.comm import _flat"),
    ("trainer", "import nnscaler.ckpt._records"),
    ("trainer", "import nnscaler.ckpt as c\nc._encode(x)"),
    ("trainer", "from nnscaler.runtime import ParallelModule\nParallelModule._fullmap"),
    ("trainer", "import nnscaler.ckpt.foo\nnnscaler.ckpt.foo._bar(1)"),
    ("lightning", "def f(opt):\n    return opt._nnscaler_zero"),
    ("lightning", "def f(opt):\n    return getattr(opt, '_nnscaler_zero', None)"),
    ("lightning", "def f(m):\n    return m.__dict__['_nnscaler_zero']"),
])
def test_private_access_checker_reports(part, source):
    others = {"runtime": {"_nnscaler_zero"}}
    assert private_access(part, source, f"nnscaler.{part}", others_set=others), f"not caught: {source!r}"


@pytest.mark.parametrize("part, source", [
    ("runtime", "from ._x import _y\nfrom nnscaler.runtime.failures import _state\nopt._nnscaler_zero = 1"),
    ("lightning", "def f(m):\n    return m._parameters"),  # torch's (FOREIGN_PRIVATE)
    ("lightning", "def f(m):\n    m._nnscaler_zero = 1\n    return m._nnscaler_zero"),  # its own as well
    ("lightning", "from nnscaler.runtime import build_optimizer\nbuild_optimizer.__name__"),
    ("lightning", "import torch\ntorch._C"),
])
def test_private_access_checker_accepts(part, source):
    assert private_access(part, source, f"nnscaler.{part}", others_set={"runtime": {"_nnscaler_zero"}}) == []


def test_checker_messages_name_file_line_and_fix():
    [msg] = _check("runtime", "x = 1\nfrom nnscaler.codegen import emit")
    assert msg.startswith("<string>:2: ")
    assert "inside the function" in msg
    [msg] = _check("trainer", "from nnscaler import parallelize")
    assert "umbrella" in msg


# ------------------------------------------------------------------- the real packages


@pytest.mark.parametrize("part", PARTS)
def test_imports_follow_dependency_rules(part):
    problems = []
    for path, package in part_sources(part):
        problems += violations(part, path.read_text(), package, str(path.relative_to(ROOT)))
    assert not problems, "\n".join(problems)


def test_no_part_uses_another_parts_private_names():
    attrs = _part_private_attributes()
    others_set = {part: sets for part, (sets, _) in attrs.items()}
    problems = []
    for part in PARTS:
        for path, package in part_sources(part):
            problems += private_access(part, path.read_text(), package, str(path.relative_to(ROOT)), others_set)
    assert not problems, "\n".join(problems)


def test_foreign_private_allow_list_is_still_needed():
    """Each allow-listed name is still read by a part that does not set it while another does."""
    attrs = _part_private_attributes()
    used = {name for part, (sets, reads) in attrs.items() for name, _, _ in reads
            if name not in sets and any(name in s for o, (s, _) in attrs.items() if o != part)}
    assert set(FOREIGN_PRIVATE) <= used, f"drop from FOREIGN_PRIVATE: {sorted(set(FOREIGN_PRIVATE) - used)}"


def _pyproject(path: Path) -> dict:
    return tomllib.loads(path.read_text())["project"]


def _nnscaler_requirements(reqs) -> list[Requirement]:
    return [r for r in map(Requirement, reqs) if r.name.startswith("nnscaler-")]


def _part_of(req: Requirement) -> str:
    return req.name[len("nnscaler-"):]


def installed_parts(part: str, extras=()) -> set[str]:
    """The parts pip installs along with ``nnscaler-<part>[extras]`` (itself included)."""
    project = _pyproject(part_dir(part) / "pyproject.toml")
    reqs = list(project.get("dependencies", []))
    for extra in extras:
        reqs += project.get("optional-dependencies", {})[extra]
    parts = {part}
    for req in _nnscaler_requirements(reqs):
        parts |= installed_parts(_part_of(req), sorted(req.extras))
    return parts


@pytest.mark.parametrize("part", PARTS)
def test_pyproject_dependencies_follow_rules(part):
    project = _pyproject(part_dir(part) / "pyproject.toml")
    assert project["name"] == f"nnscaler-{part}"
    for req in _nnscaler_requirements(project.get("dependencies", [])):
        assert _part_of(req) in ALLOWED[part], f"nnscaler-{part} must not depend on {req}"
    for extra, reqs in project.get("optional-dependencies", {}).items():
        for req in _nnscaler_requirements(reqs):
            assert _part_of(req) in ALLOWED[part] | LAZY_ALLOWED.get(part, set()), (
                f"nnscaler-{part}[{extra}] must not depend on {req}")


@pytest.mark.parametrize("part", PARTS)
def test_pyproject_installs_what_the_code_imports(part):
    eager, lazy = set(), set()
    for path, package in part_sources(part):
        for imp in nnscaler_imports(path.read_text(), package, str(path)):
            (lazy if imp.lazy else eager).add(imp.target)
    missing = eager - installed_parts(part)
    assert not missing, f"nnscaler-{part} imports {sorted(missing)} but does not depend on them"
    extras = _pyproject(part_dir(part) / "pyproject.toml").get("optional-dependencies", {})
    missing = (lazy & LAZY_ALLOWED.get(part, set())) - installed_parts(part, extras)
    assert not missing, f"nnscaler-{part} imports {sorted(missing)} lazily but no extra has them"


def test_runtime_compile_extra_brings_the_compile_time_parts():
    assert installed_parts("runtime") == {"runtime", "ir"}
    assert installed_parts("runtime", ["compile"]) == {"runtime", "ir", "policies", "codegen"}


def test_umbrella_depends_on_every_part():
    project = _pyproject(ROOT / "pyproject.toml")
    reqs = {req.name: req for req in _nnscaler_requirements(project["dependencies"])}
    assert set(reqs) == {f"nnscaler-{part}" for part in PARTS}
    assert "compile" in reqs["nnscaler-runtime"].extras


@pytest.mark.parametrize("part", PARTS)
def test_parts_are_namespace_portions(part):
    src = part_dir(part) / "src" / "nnscaler"
    assert not (src / "__init__.py").exists(), (
        f"{src}/__init__.py: only the umbrella owns nnscaler/__init__.py (PEP 420)")
    assert (src / part / "__init__.py").is_file()
    assert (part_dir(part) / "README.md").is_file()


def test_every_package_directory_is_a_known_part():
    found = {p.name for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").exists()}
    assert found == {f"nnscaler-{part}" for part in PARTS}


@pytest.mark.parametrize("part", PARTS)
@pytest.mark.multiprocess  # a fresh interpreter
def test_part_imports_in_fresh_interpreter(part):
    code = (f"import sys, nnscaler.{part}\n"
            "print(' '.join(sorted({m.split('.')[1] for m in sys.modules\n"
            "                       if m.startswith('nnscaler.')})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=ROOT / "packages")
    assert out.returncode == 0, out.stderr
    loaded = set(out.stdout.split())
    assert part in loaded
    assert loaded <= {part} | ALLOWED[part], (
        f"import nnscaler.{part} loaded {sorted(loaded - {part} - ALLOWED[part])}")
