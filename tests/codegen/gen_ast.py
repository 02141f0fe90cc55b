"""Read generated modules as code, not text: the statements of a method, the calls they make,
which value feeds which call. Tests assert on these (or run the module) instead of on substrings,
which also match comments, dead code and the wrong operand."""
from __future__ import annotations

import ast
from typing import Dict, List, Optional


def method(text: str, name: str, cls: Optional[str] = None) -> ast.FunctionDef:
    """The method `name` of the (first, or named) class of a generated module."""
    tree = ast.parse(text)
    classes = [n for n in tree.body if isinstance(n, ast.ClassDef) and (cls is None or n.name == cls)]
    assert classes, f"no class {cls or ''} in the generated module"
    found = [n for n in classes[0].body if isinstance(n, ast.FunctionDef) and n.name == name]
    assert found, f"no method {name} in class {classes[0].name}"
    return found[0]


def class_constant(text: str, name: str):
    """The literal value of a class-level `NAME = <literal>` of the module's first class."""
    tree = ast.parse(text)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef))
    for stmt in cls.body:
        if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in stmt.targets):
            return ast.literal_eval(stmt.value)
    raise AssertionError(f"no class constant {name} in {cls.name}")


def dotted(node: ast.AST) -> str:
    """`a.b.c` for a Name/Attribute chain, '' otherwise."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""


def calls(fn: ast.AST, name: str) -> List[ast.Call]:
    """Every call in `fn` whose callee is `name` (dotted, e.g. 'nr.comm.all_gather'), or ends
    with '.name' when `name` starts with a dot (a method call such as '.size')."""
    out = []
    for node in ast.walk(fn):
        if isinstance(node, ast.Call):
            callee = dotted(node.func) or (("?." + node.func.attr) if isinstance(node.func, ast.Attribute) else "")
            if callee == name or (name.startswith(".") and callee.endswith(name)):
                out.append(node)
    return out


def assigned(fn: ast.FunctionDef) -> Dict[str, ast.AST]:
    """{name: value} of the simple `name = value` statements of `fn` (anywhere in its body)."""
    return {s.targets[0].id: s.value for s in ast.walk(fn)
            if isinstance(s, ast.Assign) and len(s.targets) == 1 and isinstance(s.targets[0], ast.Name)}


def producer(fn: ast.FunctionDef, name: str) -> ast.AST:
    """The expression assigned to `name` in `fn`."""
    values = assigned(fn)
    assert name in values, f"{name} is never assigned in {fn.name}"
    return values[name]


def names_in(node: ast.AST) -> List[str]:
    return [n.id for n in ast.walk(node) if isinstance(n, ast.Name)]
