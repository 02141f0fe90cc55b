"""How fully sharded data parallelism (``use_zero=3``) groups parameters into units: the rule the
runtime applies (`nnscaler.runtime.zero3`) and the policies' cost models price
(`nnscaler.policies.autodist`), so both see the same units."""
from __future__ import annotations

import fnmatch
from typing import Any, Collection, Dict, List, Mapping, Sequence, Tuple, Union

from ..errors import ConfigError

__all__ = ["ROOT_UNIT", "unit_names", "root_modules", "resolve_unit_modules", "kept_after_forward"]

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


def kept_after_forward(units: Collection[str], setting: Any) -> List[str]:
    """The units (by name, `unit_names`' values) not freed after forward, from
    ``pas_config["zero3_reshard_after_forward"]`` (FSDP2's ``reshard_after_forward``): True (the
    default: every unit is freed after forward and gathered again in backward), False (every unit
    kept gathered until its backward: no gather in backward, more memory between), or a mapping
    of unit names or globs (``"model.layers.*"``; ``""`` is the root) to True / False, the first
    matching entry deciding (units no entry matches: True). Raises ConfigError for another value
    (FSDP2's int, resharding to a smaller group, is not supported)."""
    key = "pas_config['zero3_reshard_after_forward']"
    if isinstance(setting, bool):
        return sorted(units) if not setting else []
    if not isinstance(setting, Mapping) or not all(isinstance(k, str) and isinstance(v, bool)
                                                   for k, v in setting.items()):
        raise ConfigError(f"{key} is {setting!r}: give True, False or a mapping of unit names or globs to True / "
                         f"False (e.g. {{'model.layers.*': False}}); resharding to a smaller group (an int) is not "
                         f"supported")
    out = []
    for unit in units:
        hit = next((v for k, v in setting.items() if fnmatch.fnmatchcase(unit, k)), True)
        if not hit:
            out.append(unit)
    return sorted(out)
