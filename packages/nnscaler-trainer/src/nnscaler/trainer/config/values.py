"""Turning config values into objects: dotted names, ``__type``, ``__value_type`` + ``value``, and
``ast.literal_eval`` guessing of strings (how component arguments are read, docs/trainer.md)."""
from __future__ import annotations

import ast
import builtins
import importlib
from typing import Any, Callable, Dict

from ..errors import TrainerConfigError
from . import components

__all__ = ["resolve_object", "guess_value", "typed_value", "build_value", "build_args", "instantiate"]

TYPE_KEY = "__type"
VALUE_TYPE_KEY = "__value_type"


_LOCAL_NAMES: Dict[str, Any] = {}  # what `local_name` added (TrainerArgs, defined above this module)


def local_name(cls):
    """Class decorator: configs may name ``cls`` unqualified, like the classes of components.py."""
    _LOCAL_NAMES[cls.__name__] = cls
    return cls


def _local_names() -> Dict[str, Any]:
    """Unqualified names a config may use: the Trainer's own config classes."""
    names = {n: getattr(components, n) for n in components.__all__}
    names.update(_LOCAL_NAMES)
    return names


def resolve_object(name: Any, key: str) -> Any:
    """The object a fully qualified name (``torch.optim.AdamW``) points to; a builtin
    (``str``) or a Trainer config class may be unqualified. A callable is returned as is."""
    if callable(name) and not isinstance(name, str):
        return name
    if not isinstance(name, str) or not name:
        raise TrainerConfigError(key, f"expected a fully qualified name like 'torch.optim.AdamW', got {name!r}")
    if "." not in name:
        local = _local_names()
        if name in local:
            return local[name]
        if hasattr(builtins, name):
            return getattr(builtins, name)
        raise TrainerConfigError(key, f"{name!r} is not a fully qualified name: write it as 'package.module.{name}'")
    parts = name.split(".")
    error = None
    for cut in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            obj = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name is not None and not module_name.startswith(e.name):  # the module itself failed inside
                raise TrainerConfigError(key, f"importing {module_name!r} for {name!r} failed: {e}") from None
            error = error or e
            continue
        except Exception as e:  # the user's module raised while importing
            raise TrainerConfigError(key, f"importing {module_name!r} for {name!r} failed: "
                                          f"{type(e).__name__}: {e}") from None
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                raise TrainerConfigError(key, f"{name!r} does not exist: module {module_name!r} has no "
                                              f"{'.'.join(parts[cut:])!r}; check the spelling")
            obj = getattr(obj, attr)
        return obj
    raise TrainerConfigError(key, f"cannot import {name!r} ({error}); give a fully qualified name of an "
                                  f"importable module (is it on PYTHONPATH?)")


def guess_value(text: str) -> Any:
    """``ast.literal_eval(text)`` when it parses ('1' -> 1, '[1, 2]' -> [1, 2], 'None' -> None),
    the string itself otherwise; 'true' / 'false' / 'null' as YAML spells them are understood."""
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("null", "~"):
        return None
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return text


def typed_value(value: Any) -> Any:
    """`value` with every string read as `build_value` reads it (``'0.05'`` -> 0.05), as plain data
    that `build_value` turns into the same object: a string read as a string that would be read
    again differently (``"'1'"`` -> ``'1'``) becomes ``{__value_type: str, value: '1'}``; one read
    as something YAML has no plain form for (a tuple, a set, bytes) stays the string it was.
    ``__type`` names and ``__value_type`` dicts stay as they are."""
    if isinstance(value, dict):
        if VALUE_TYPE_KEY in value:
            return value
        return {k: (v if k == TYPE_KEY else typed_value(v)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(typed_value(v) for v in value)
    if isinstance(value, str):
        read = guess_value(value)
        return _kept(read) if _plain(read) else value
    return value


def _plain(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, list):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and k != TYPE_KEY and _plain(v) for k, v in value.items())
    return False


def _kept(value: Any) -> Any:
    """A value literal_eval produced, with its strings protected from a second reading."""
    if isinstance(value, str):
        return {VALUE_TYPE_KEY: "str", "value": value} if guess_value(value) != value else value
    if isinstance(value, list):
        return [_kept(v) for v in value]
    if isinstance(value, dict):
        return {k: _kept(v) for k, v in value.items()}
    return value


def build_value(value: Any, key: str) -> Any:
    """A config value as the object it describes (see the module docstring)."""
    if isinstance(value, dict):
        if VALUE_TYPE_KEY in value:
            extra = set(value) - {VALUE_TYPE_KEY, "value"}
            if "value" not in value or extra:
                raise TrainerConfigError(key, f"a dict with {VALUE_TYPE_KEY!r} must have exactly the keys "
                                              f"{VALUE_TYPE_KEY!r} and 'value'")
            kind = resolve_object(value[VALUE_TYPE_KEY], f"{key}.{VALUE_TYPE_KEY}")
            try:
                return kind(value["value"])
            except Exception as e:
                raise TrainerConfigError(key, f"{value[VALUE_TYPE_KEY]}({value['value']!r}) failed: {e}") from None
        if TYPE_KEY in value:
            kind = resolve_object(value[TYPE_KEY], f"{key}.{TYPE_KEY}")
            kwargs = {k: build_value(v, f"{key}.{k}") for k, v in value.items() if k != TYPE_KEY}
            return instantiate(kind, kwargs, key)
        return {k: build_value(v, f"{key}.{k}") for k, v in value.items()}
    if isinstance(value, list):
        return [build_value(v, f"{key}.{i}") for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return tuple(build_value(v, f"{key}.{i}") for i, v in enumerate(value))
    if isinstance(value, str):
        return guess_value(value)
    return value


def build_args(args: Dict[str, Any], key: str) -> Dict[str, Any]:
    """Component arguments as keyword arguments (values built by `build_value`)."""
    if args is None:
        return {}
    if not isinstance(args, dict):
        raise TrainerConfigError(key, f"must be a mapping of argument names to values, got {type(args).__name__}")
    return {k: build_value(v, f"{key}.{k}") for k, v in args.items()}


def instantiate(kind: Callable, kwargs: Dict[str, Any], key: str, *positional: Any) -> Any:
    """``kind(*positional, **kwargs)``; a TypeError about the arguments names the config key."""
    try:
        return kind(*positional, **kwargs)
    except TypeError as e:
        name = getattr(kind, "__qualname__", repr(kind))
        raise TrainerConfigError(key, f"{name}(...) rejected the arguments {sorted(kwargs)}: {e}") from None
