"""Partition constraints (``partition_constraints_path``): a YAML list of rules, each limiting
the choices of the ops it matches::

    - module: "h.*.attn"        # module class name or module path glob (optional)
      op: linear                # op name glob, e.g. linear, matmul, "torch.nn.functional.*" (optional)
      allowed: [R, n]           # choice labels: R (replicate) and annotated dims
    - module: LayerNorm
      replicate: true           # the same as allowed: [R]

A rule that matches no op, an unknown key, or a rule that leaves an op without any choice is an
error naming the rule. Later rules narrow what earlier ones allowed.
"""
from __future__ import annotations

import fnmatch
from typing import Dict, List

from nnscaler.ir import ConfigError, IRGraph

from .choices import matches_module, node_choices

__all__ = ["load_constraints"]

_KEYS = {"module", "op", "allowed", "replicate"}


def load_constraints(path, graph: IRGraph, n: int) -> Dict[int, List[str]]:
    """node id -> allowed choice labels, for every op a rule matches."""
    import yaml
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"cannot read partition_constraints_path {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"partition constraints {path} is not valid YAML: {e}") from None
    if isinstance(data, dict) and set(data) == {"constraints"}:
        data = data["constraints"]
    if not isinstance(data, list):
        raise ConfigError(f"partition constraints {path} must be a YAML list of rules "
                          f"(each with module / op and allowed / replicate), got {type(data).__name__}")
    allowed: Dict[int, List[str]] = {}
    for i, rule in enumerate(data):
        where = f"{path}: rule {i + 1}"
        if not isinstance(rule, dict):
            raise ConfigError(f"{where} must be a mapping with module / op and allowed / replicate, got {rule!r}")
        unknown = sorted(set(rule) - _KEYS)
        if unknown:
            raise ConfigError(f"{where} has unknown key(s) {unknown}; the keys are {sorted(_KEYS)}")
        if "module" not in rule and "op" not in rule:
            raise ConfigError(f"{where} names neither a module nor an op: give 'module' and/or 'op'")
        if ("allowed" in rule) == ("replicate" in rule):
            raise ConfigError(f"{where} needs exactly one of 'allowed: [R, <dim>, ...]' and 'replicate: true'")
        if "replicate" in rule:
            if rule["replicate"] is not True:
                raise ConfigError(f"{where}: replicate must be true (drop the rule to allow every choice)")
            labels = ["R"]
        else:
            labels = rule["allowed"]
            if not isinstance(labels, list) or not labels or not all(isinstance(x, str) for x in labels):
                raise ConfigError(f"{where}: allowed must be a non-empty list of choice labels (R, or dim names of "
                                  f"the op's annotation such as n, k, b0), got {labels!r}")
        hits = 0
        for node in graph.nodes:
            if "op" in rule and not (fnmatch.fnmatchcase(node.short_name, str(rule["op"]))
                                     or fnmatch.fnmatchcase(node.target, str(rule["op"]))):
                continue
            if "module" in rule and not matches_module(node, graph.module_types, str(rule["module"])):
                continue
            hits += 1
            have = [c.label for c in node_choices(graph, node, n)]
            keep = [x for x in have if x in labels and x in allowed.get(node.id, have)]
            if not keep:
                raise ConfigError(f"{where} leaves op {node.describe()} no choice: it allows {labels}, the op can "
                                  f"take {[x for x in have if x in allowed.get(node.id, have)]} on {n} devices")
            allowed[node.id] = keep
        if hits == 0:
            raise ConfigError(f"{where} ({rule}) matches no op of {graph.module_class}; check the module class name "
                              f"or path glob and the op name")
    return allowed
