"""``${...}`` references inside config values.

``${a.b.c}`` is the value at that key path of the same config (e.g. ``${vars.dim}`` with a
top-level ``vars:`` section of your own values); ``${env.NAME}`` is an environment variable.
A string that is exactly one reference takes the referenced value with its type; references
inside a longer string are formatted in. References may chain; a cycle is an error naming it.
"""
from __future__ import annotations

import os
import re
from typing import Any, Dict, List

from ..errors import TrainerConfigError

__all__ = ["resolve_references"]

_REF = re.compile(r"\$\{([^${}]+)\}")


class _Resolver:
    def __init__(self, root: Dict[str, Any]):
        self.root = root
        self.done: Dict[str, Any] = {}
        self.stack: List[str] = []

    def lookup(self, path: str, where: str) -> Any:
        if path.startswith("env."):
            name = path[4:]
            if name not in os.environ:
                raise TrainerConfigError(where, f"${{{path}}}: environment variable {name!r} is not set")
            return os.environ[name]
        if path in self.done:
            return self.done[path]
        if path in self.stack:
            cycle = " -> ".join([*self.stack[self.stack.index(path):], path])
            raise TrainerConfigError(where, f"reference cycle: {cycle}")
        node: Any = self.root
        for part in path.split("."):
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                raise TrainerConfigError(where, f"${{{path}}} refers to a key that does not exist")
        value = self.resolve(node, path)
        self.done[path] = value
        return value

    def resolve(self, value: Any, where: str) -> Any:
        if isinstance(value, dict):
            return {k: self.resolve(v, f"{where}.{k}" if where else k) for k, v in value.items()}
        if isinstance(value, list):
            return [self.resolve(v, f"{where}.{i}") for i, v in enumerate(value)]
        if not isinstance(value, str) or "${" not in value:
            return value
        pushed = bool(where) and where not in self.stack
        if pushed:
            self.stack.append(where)
        try:
            whole = _REF.fullmatch(value.strip())
            if whole:
                return self.lookup(whole.group(1).strip(), where)
            return _REF.sub(lambda m: str(self.lookup(m.group(1).strip(), where)), value)
        finally:
            if pushed:
                self.stack.pop()


def resolve_references(data: Dict[str, Any]) -> Dict[str, Any]:
    """A copy of `data` with every ``${...}`` replaced (see the module docstring)."""
    resolver = _Resolver(data)
    return resolver.resolve(data, "")
