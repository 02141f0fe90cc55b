"""YAML in, YAML out: load a config file, apply overrides and references; dump a resolved one."""
from __future__ import annotations

from typing import Any, Dict, List

from ..errors import TrainerConfigError
from .overrides import apply_overrides
from .references import resolve_references

__all__ = ["load_config", "dump_yaml"]


def load_config(path: str, overrides: List[str]) -> Dict[str, Any]:
    """The YAML file at `path` with `overrides` (command-line tokens) applied and ``${...}``
    references resolved, as plain data."""
    import yaml
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except FileNotFoundError:
        raise TrainerConfigError("", f"config file {path!r} does not exist") from None
    except yaml.YAMLError as e:
        raise TrainerConfigError("", f"config file {path!r} is not valid YAML: {e}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise TrainerConfigError("", f"config file {path!r} must hold a mapping of TrainerArgs keys, "
                                     f"got {type(data).__name__}")
    return resolve_references(apply_overrides(data, overrides))


def dump_yaml(data: Dict[str, Any]) -> str:
    """`data` as YAML, keys in their definition order."""
    import yaml
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False)
