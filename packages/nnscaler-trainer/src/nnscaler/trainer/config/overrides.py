"""Command-line overrides of a config: ``--a.b.c VALUE``, ``--a.b.c=VALUE``, list indices
(``--log.0.type X``) and ``--a.b!`` (remove the key).

Values stay strings here; the typed conversion (`typed.from_data`) and the component argument
builder (`values.build_value`) read them with ``ast.literal_eval`` where a non-string is meant.
A bare ``--flag`` followed by another option (or nothing) means ``true``.
"""
from __future__ import annotations

import copy
from typing import Any, Dict, List, Tuple

from ..errors import TrainerConfigError

__all__ = ["parse_overrides", "apply_overrides", "set_path", "remove_path"]

REMOVE = object()  # the value of a `--key!` override


def parse_overrides(argv: List[str]) -> List[Tuple[str, Any]]:
    """``['--a.b', '1', '--c=x', '--d!']`` -> ``[('a.b', '1'), ('c', 'x'), ('d', REMOVE)]``."""
    out, i = [], 0
    while i < len(argv):
        token = argv[i]
        if not token.startswith("--") or len(token) == 2:
            raise TrainerConfigError("", f"unexpected argument {token!r}: overrides are written --key value, "
                                         f"--key=value or --key! (remove)")
        body = token[2:]
        if "=" in body:
            key, value = body.split("=", 1)
            i += 1
        elif body.endswith("!"):
            key, value = body[:-1], REMOVE
            i += 1
        elif i + 1 < len(argv) and not (argv[i + 1].startswith("--") and len(argv[i + 1]) > 2):
            key, value = body, argv[i + 1]
            i += 2
        else:
            key, value = body, "true"
            i += 1
        if not key or any(not part for part in key.split(".")):
            raise TrainerConfigError(key, f"malformed override {token!r}: use --a.b.c VALUE")
        out.append((key, value))
    return out


def _step(container: Any, part: str, key: str, create: bool, next_part: str = "") -> Any:
    if isinstance(container, list):
        if not part.isdigit():
            raise TrainerConfigError(key, f"{part!r} indexes a list: use a number (0, 1, ...)")
        index = int(part)
        if index == len(container) and create:
            container.append([] if next_part.isdigit() else {})
        if index >= len(container):
            raise TrainerConfigError(key, f"index {index} is past the end of the list (length {len(container)})")
        if container[index] is None and create:
            container[index] = {}
        return container[index]
    if isinstance(container, dict):
        if part not in container or container[part] is None:
            if not create:
                raise TrainerConfigError(key, f"no key {part!r} to remove")
            container[part] = [] if next_part.isdigit() else {}
        return container[part]
    raise TrainerConfigError(key, f"cannot go into {type(container).__name__} value at {part!r}")


def set_path(data: Dict[str, Any], key: str, value: Any) -> None:
    """``data[a][b][c] = value`` for ``key='a.b.c'``, creating mappings on the way."""
    parts = key.split(".")
    *parents, last = parts
    node = data
    for i, part in enumerate(parents):
        node = _step(node, part, key, create=True, next_part=parts[i + 1])
    if isinstance(node, list):
        if not last.isdigit():
            raise TrainerConfigError(key, f"{last!r} indexes a list: use a number")
        index = int(last)
        if index == len(node):
            node.append(value)
        elif index < len(node):
            node[index] = value
        else:
            raise TrainerConfigError(key, f"index {index} is past the end of the list (length {len(node)})")
    elif isinstance(node, dict):
        node[last] = value
    else:
        raise TrainerConfigError(key, f"cannot set a key inside a {type(node).__name__} value")


def remove_path(data: Dict[str, Any], key: str) -> None:
    """Delete ``data[a][b][c]`` for ``key='a.b.c'``; a missing key is an error."""
    *parents, last = key.split(".")
    node = data
    for part in parents:
        node = _step(node, part, key, create=False)
    if isinstance(node, list) and last.isdigit() and int(last) < len(node):
        del node[int(last)]
    elif isinstance(node, dict) and last in node:
        del node[last]
    else:
        raise TrainerConfigError(key, f"no key {last!r} to remove (--{key}!)")


def apply_overrides(data: Dict[str, Any], argv: List[str]) -> Dict[str, Any]:
    """A copy of `data` with the overrides of `argv` applied in order."""
    data = copy.deepcopy(data)
    for key, value in parse_overrides(argv):
        if value is REMOVE:
            remove_path(data, key)
        else:
            set_path(data, key, value)
    return data
