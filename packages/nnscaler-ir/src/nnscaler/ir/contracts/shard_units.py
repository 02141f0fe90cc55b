"""How fully sharded data parallelism (``use_zero=3``) groups parameters into units: the rule the
runtime applies (`nnscaler.runtime.zero3`) and the policies' cost models price
(`nnscaler.policies.autodist`), so both see the same units."""
from __future__ import annotations

import fnmatch
from typing import Any, Collection, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from ..errors import ConfigError

__all__ = ["ROOT_UNIT", "unit_names", "root_modules", "resolve_unit_modules", "kept_after_forward",
           "reshard_sizes", "smaller_sizes"]

ROOT_UNIT = ""


def unit_names(full_names: Sequence[str], unit_modules: Sequence[str] = ()) -> Dict[str, str]:
    """full (single-device) parameter name -> its unit; ``""`` is the root unit.

    Each repeated block is a unit: the outermost ``<prefix>.<i>`` whose prefix holds at least two
    indices (``model.layers.0``, ``h.3``; an MoE layer's experts stay inside their decoder layer), as
    FSDP's auto-wrap of each decoder layer. `unit_modules` (``pas_config["zero3_units"]`` resolved,
    and `root_modules`: module paths) add units to that rule, as FSDP2's ``fully_shard`` on a
    sub-module: a name goes to the longest of its block and the named paths it starts with (a path
    inside a block splits it, a path around blocks keeps them), else to the root."""
    prefixes = sorted(unit_modules, key=len, reverse=True)
    indices: Dict[Tuple[str, ...], set] = {}
    for name in full_names:
        parts = name.split(".")
        for i, part in enumerate(parts[:-1]):
            if part.isdigit():
                indices.setdefault(tuple(parts[:i]), set()).add(part)
    out = {}
    for name in full_names:
        parts = name.split(".")
        block = next((".".join(parts[:i + 1]) for i, part in enumerate(parts[:-1])
                      if part.isdigit() and len(indices[tuple(parts[:i])]) > 1), ROOT_UNIT)
        named = next((p for p in prefixes if name.startswith(p + ".")), ROOT_UNIT)
        out[name] = max(block, named, key=len)
    return out


def root_modules(full_names: Sequence[str], shapes: Mapping[str, Sequence[int]], unit_modules: Sequence[str] = (),
                 tied: Collection[str] = ()) -> List[str]:
    """The modules outside every block and named unit that hold a matrix (a parameter of two or more
    dims: the token and position embeddings, the output head): each is made a unit of its own (as
    torchtitan shards the embedding and the head apart from the root), so that the root, gathered
    from its first use in forward to the end of backward, keeps only small tensors (the final norm).
    A module holding a tied tensor (`tied`: full names of tensors with another name, an embedding
    tied to the head, used at both ends of forward) stays in the root, as does a module with other
    root parameters deeper under its path. `shapes`: full name -> shape."""
    units = unit_names(full_names, unit_modules)
    root = [n for n in full_names if units[n] == ROOT_UNIT and "." in n]
    owners = {n.rsplit(".", 1)[0] for n in root}
    out = set()
    for name in root:
        module = name.rsplit(".", 1)[0]
        if len(shapes[name]) < 2 or any(t.startswith(module + ".") for t in tied):
            continue
        if not any(o != module and o.startswith(module + ".") for o in owners):
            out.add(module)
    return sorted(out)


def resolve_unit_modules(module_types: Mapping[str, str], names: Union[str, Sequence[str]]) -> List[str]:
    """The module paths `names` (``pas_config["zero3_units"]``) stand for in a traced model
    (`module_types`: module path -> "pkg.mod.Class", `IRGraph.module_types`), as FSDP's wrap policy
    takes module classes: each name is a module class (``LlamaDecoderLayer``), a qualified class
    (``gpt.Block``), a path glob (``model.layers.*.mlp``) or a module path; a string holds them
    separated by commas. Raises ConfigError for a name that matches no module, naming the module
    types there are."""
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    out: List[str] = []
    for name in names:
        hits = [path for path, cls in module_types.items() if path and (
            cls == name or cls.rsplit(".", 1)[-1] == name or fnmatch.fnmatchcase(path, name))]
        if not hits:
            kinds = sorted({c.rsplit(".", 1)[-1] for p, c in module_types.items() if p})
            raise ConfigError(f"pas_config['zero3_units']: {name!r} matches no module of the model; module types "
                             f"there: {', '.join(kinds)} (or give a module path or a path glob)")
        out.extend(h for h in hits if h not in out)
    return sorted(out)


_KEY = "pas_config['zero3_reshard_after_forward']"


def _check_size(where: str, value: Any, group_size: Optional[int]) -> None:
    """`value` (one setting of ``zero3_reshard_after_forward``) is a bool or an int k >= 1 dividing
    `group_size` (None: not known yet, only k >= 1 checked); ConfigError naming `where` otherwise."""
    if isinstance(value, bool):
        return
    fix = "True (reshard to the whole zero group), False (keep gathered) or an int"
    if group_size is not None:
        divisors = [k for k in range(1, group_size + 1) if group_size % k == 0]
        fix += (f" dividing the zero group size {group_size} (runtime_ngpus // plan_ngpus // zero_ngroups): "
                f"{', '.join(map(str, divisors))}")
    else:
        fix += " >= 1 dividing the zero group size"
    if isinstance(value, str):
        raise ConfigError(f"{where} is the string {value!r}: give the bool or the int itself, not a string: {fix} "
                          f"(the int 1 keeps the unit gathered like False; True reshards to the whole group). In "
                          f"YAML write it unquoted (the Trainer's command line reads "
                          f"--compute_config.pas_config.zero3_reshard_after_forward 2 as the int)")
    if not isinstance(value, int):
        raise ConfigError(f"{where} is {value!r}: give {fix}, or a mapping of unit names or globs to those "
                          f"(e.g. {{'model.layers.*': 2}})")
    if value < 1:
        raise ConfigError(f"{where} is {value}: an int is the size of the smaller group a unit is resharded to after "
                          f"forward (FSDP2's reshard_after_forward=int), at least 1; give {fix}")
    if group_size is not None and group_size % value:
        raise ConfigError(f"{where} is {value}, which does not divide the zero group size {group_size}: each of "
                          f"the smaller groups of that many ranks holds a whole unit after forward; give {fix}")


def _settings(units: Collection[str], setting: Any, group_size: Optional[int]) -> Dict[str, Any]:
    """unit name -> its value (True, False or an int) in a checked `setting`."""
    if isinstance(setting, Mapping):
        if not all(isinstance(k, str) for k in setting):
            raise ConfigError(f"{_KEY} is {setting!r}: a mapping's keys are unit names or globs (strings, "
                             f"e.g. 'model.layers.*'; '' is the root)")
        for k, v in setting.items():
            _check_size(f"{_KEY}[{k!r}]", v, group_size)
        return {u: next((v for k, v in setting.items() if fnmatch.fnmatchcase(u, k)), True) for u in units}
    _check_size(_KEY, setting, group_size)
    return dict.fromkeys(units, setting)


def reshard_sizes(units: Collection[str], setting: Any, group_size: Optional[int]) -> Dict[str, int]:
    """unit name -> the size k of the group it is resharded to after forward, from
    ``pas_config["zero3_reshard_after_forward"]`` (FSDP2's ``reshard_after_forward``), `group_size`
    being the zero group's size z: True (the default: k = z, every unit freed after forward and
    gathered again in backward from the whole zero group), False (k = 1: kept gathered until its
    backward), an int k dividing z (each rank keeps 1/k of the unit after forward, the k consecutive
    ranks of its zero group together hold it all, and backward all-gathers among them only: the
    int 1 is False, the int z is True, and the bool True is never the int 1), or a mapping of unit
    names or globs (``"model.layers.*"``; ``""`` is the root) to those, the first matching entry
    deciding (units no entry matches: True). With `group_size` None every k is only checked to be an
    int >= 1 and True maps to 0 ("the whole group"). Raises ConfigError for another value."""
    return {u: (group_size or 0) if v is True else 1 if v is False else int(v)
            for u, v in _settings(units, setting, group_size).items()}


def smaller_sizes(setting: Any, group_size: int) -> List[int]:
    """The group sizes k (1 < k < z) that ``zero3_reshard_after_forward`` names anywhere (the same on
    every rank, whatever units a rank holds): the smaller groups the runtime creates."""
    values = setting.values() if isinstance(setting, Mapping) else [setting]
    return sorted({int(v) for v in values if not isinstance(v, bool) and isinstance(v, int) and 1 < v < group_size})


def kept_after_forward(units: Collection[str], setting: Any, group_size: Optional[int] = None) -> List[str]:
    """The units (by name, `unit_names`' values) not freed after forward: False or the int 1 (a group
    of one rank; True is never kept, even when the zero group has one rank). Raises ConfigError for a
    bad ``pas_config["zero3_reshard_after_forward"]``."""
    return sorted(u for u, v in _settings(units, setting, group_size).items() if v is False or v is not True and v == 1)
