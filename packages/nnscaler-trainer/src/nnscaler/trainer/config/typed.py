"""Plain data (a YAML mapping, command-line strings) into the typed config dataclasses.

Every error names the key path and the fix: an unknown key suggests the nearest valid one, a
value of the wrong type says the expected type. Strings given for non-string fields are read
with `guess_value` (``'2'`` -> 2), so command-line overrides need no quoting.
"""
from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Any, Dict, List, Union

from nnscaler.ir import ComputeConfig, ConfigError, OptionalComputeConfig

from ..errors import TrainerConfigError
from .values import guess_value, typed_value

__all__ = ["from_data", "to_data", "unknown_key_error"]

_NONE = type(None)


def unknown_key_error(key_path: str, name: str, valid) -> TrainerConfigError:
    """'unknown key' with the nearest valid names."""
    near = difflib.get_close_matches(name, list(valid), n=2, cutoff=0.5)
    hint = f"did you mean {' or '.join(repr(n) for n in near)}?" if near else \
        f"valid keys: {', '.join(sorted(valid))}"
    return TrainerConfigError(key_path, f"unknown key {name!r}; {hint}")


def _join(prefix: str, name: Any) -> str:
    return f"{prefix}.{name}" if prefix else str(name)


def _type_name(tp: Any) -> str:
    if tp is _NONE:
        return "null"
    origin = typing.get_origin(tp)
    if origin is Union:
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin in (list, List):
        return "a list"
    if origin in (dict, Dict):
        return "a mapping"
    return getattr(tp, "__name__", str(tp))


def from_data(tp: Any, value: Any, key: str) -> Any:
    """`value` converted to the annotation `tp` (dataclasses, Optional/Union, List, Dict, scalars)."""
    if tp is Any:
        return value
    if isinstance(tp, str):  # a forward reference left by `from __future__ import annotations`
        raise AssertionError(f"unresolved annotation {tp!r}")
    origin = typing.get_origin(tp)
    if origin is Union:
        options = typing.get_args(tp)
        if value is None and _NONE in options:
            return None
        if isinstance(value, str) and str not in options:
            value = guess_value(value)
            if value is None and _NONE in options:
                return None
        errors = []
        for option in options:
            if option is _NONE:
                continue
            if dataclasses.is_dataclass(option) and not isinstance(value, (dict, option)):
                continue
            if dataclasses.is_dataclass(option) and isinstance(value, dict) and not _fits(option, value):
                continue
            try:
                return from_data(option, value, key)
            except TrainerConfigError as e:
                errors.append(e)
        if len(errors) == 1:
            raise errors[0]
        shapes = [o for o in options if dataclasses.is_dataclass(o)]
        if not errors and isinstance(value, dict) and shapes:  # fits none: name the unknown key
            def closeness(o):
                names = [f.name for f in dataclasses.fields(o)]
                near = sum(bool(difflib.get_close_matches(str(k), names, n=1, cutoff=0.5)) for k in value)
                return len(set(value) & set(names)), near
            best = max(shapes, key=closeness)
            return _dataclass(best, value, key)
        raise TrainerConfigError(key, f"expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
    if origin in (list, List):
        (item,) = typing.get_args(tp) or (Any,)
        if isinstance(value, str):
            value = guess_value(value)
        if isinstance(value, tuple):
            value = list(value)
        if not isinstance(value, list):
            raise TrainerConfigError(key, f"expected a list, got {type(value).__name__} {value!r}")
        return [from_data(item, v, _join(key, i)) for i, v in enumerate(value)]
    if origin in (dict, Dict):
        if isinstance(value, str):
            value = guess_value(value)
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise TrainerConfigError(key, f"expected a mapping, got {type(value).__name__} {value!r}")
        if typing.get_args(tp)[1:] == (Any,):  # component arguments: typed as they will be used
            return {k: typed_value(v) for k, v in value.items()}
        return dict(value)
    if tp is ComputeConfig or tp is OptionalComputeConfig:
        return _compute_config(tp, value, key)
    if dataclasses.is_dataclass(tp):
        return _dataclass(tp, value, key)
    return _scalar(tp, value, key)


def _fits(cls: type, value: Dict[str, Any]) -> bool:
    names = {f.name for f in dataclasses.fields(cls)}
    return set(value) <= names


def _scalar(tp: type, value: Any, key: str) -> Any:
    if value is None and tp in (str, int, float):  # fields declared `name: str = None` (unset)
        return None
    if tp is str:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        if not isinstance(value, str):
            raise TrainerConfigError(key, f"expected a string, got {type(value).__name__} {value!r}")
        return value
    if isinstance(value, str):
        value = guess_value(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise TrainerConfigError(key, f"expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise TrainerConfigError(key, f"expected an integer, got {type(value).__name__} {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TrainerConfigError(key, f"expected a number, got {type(value).__name__} {value!r}")
        return float(value)
    if not isinstance(value, tp):
        raise TrainerConfigError(key, f"expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
    return value


def _dataclass(cls: type, value: Any, key: str) -> Any:
    if isinstance(value, cls):
        return value
    if isinstance(value, str):
        value = guess_value(value)
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise TrainerConfigError(key, f"expected a mapping of {cls.__name__} fields, got "
                                      f"{type(value).__name__} {value!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for name, item in value.items():
        if name not in fields:
            raise unknown_key_error(key, str(name), fields)
        kwargs[name] = from_data(hints[name], item, _join(key, name))
    return cls(**kwargs)


def _compute_config(cls: type, value: Any, key: str) -> Any:
    if isinstance(value, cls):
        return value
    if isinstance(value, str):
        value = guess_value(value)
    if not isinstance(value, dict):
        raise TrainerConfigError(key, f"expected a mapping of {cls.__name__} fields, got {type(value).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for name, item in value.items():
        if name not in fields:
            raise unknown_key_error(key, str(name), fields)
        if isinstance(item, str) and hints[name] is not str and typing.get_args(hints[name]) != (str, _NONE):
            item = guess_value(item)
        if name in ("pas_config", "user_config") and isinstance(item, dict):
            item = _read_leaves(item)  # `--compute_config.pas_config.k 2` gives the string '2'
        kwargs[name] = item
    if cls is ComputeConfig:
        missing = [n for n in ("plan_ngpus", "runtime_ngpus") if n not in kwargs]
        if missing:
            raise TrainerConfigError(_join(key, missing[0]), "is required (plan_ngpus: processes holding one "
                                                             "copy of the model; runtime_ngpus: the world size)")
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise TrainerConfigError(key, str(e).replace("ComputeConfig.", "")) from None


def _read_leaves(value: Any) -> Any:
    """A mapping's strings read as the command line means them ('2' -> 2, 'false' -> False,
    '[1, 2]' -> [1, 2]); a string that reads as nothing else stays itself."""
    if isinstance(value, dict):
        return {k: _read_leaves(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_read_leaves(v) for v in value]
    return guess_value(value) if isinstance(value, str) else value


def to_data(obj: Any) -> Any:
    """A config dataclass (or value) as plain YAML-able data, None fields included."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_data(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {k: to_data(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_data(v) for v in obj]
    return obj
