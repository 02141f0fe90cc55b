"""Which tensors of a Hugging Face directory make each tensor of the module: the names as they are,
or as transformers 5 renames and fuses them when it loads a mixture-of-experts checkpoint.

Hub checkpoints (and transformers 5's own ``save_pretrained``) store the experts one by one
(Mixtral ``model.layers.0.block_sparse_moe.experts.3.w1.weight``, Qwen2/3-MoE and DeepSeek-V3
``model.layers.0.mlp.experts.3.gate_proj.weight``) while the module holds them fused
(``mlp.experts.gate_up_proj`` [experts, 2 * intermediate, hidden], ``mlp.experts.down_proj``
[experts, hidden, intermediate]). The rules are transformers' ``conversion_mapping.py``
(``WeightRenaming(".block_sparse_moe.", ".mlp.")``; ``WeightConverter`` with
``MergeModulelist(dim=0)`` then ``Concatenate(dim=1)``): expert ``e``'s gate (``w1`` /
``gate_proj`` / ``fc1``) is rows ``[0, I)`` of ``gate_up_proj[e]``, its up (``w3`` / ``up_proj`` /
``fc3``) rows ``[I, 2I)``; its down (``w2`` / ``down_proj`` / ``fc2``) is ``down_proj[e]``. Each
per-expert tensor is then one piece of the fused tensor (its region: expert ``e``, its rows), so a
rank reads only the experts and rows it holds. A rule applies to a tensor only when the module has
the converted name and not the file's own (a module that keeps its experts in a ``ModuleList``
takes the names as they are). This package never imports transformers.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from .errors import CheckpointError

__all__ = ["Source", "Target", "converted_name", "targets"]

Region = Tuple[Tuple[int, int], ...]

RENAMES = ((".block_sparse_moe.", ".mlp."),)  # transformers' "mixtral" WeightRenaming
# fused name -> the per-expert names concatenated along dim 1 (in this order), one tuple per model family
FUSED = {"gate_up_proj": (("w1", "w3"), ("gate_proj", "up_proj"), ("fc1", "fc3")),
         "down_proj": (("w2",), ("down_proj",), ("fc2",))}
_FUSED_OF = {part: fused for fused, families in FUSED.items() for family in families for part in family}
PER_EXPERT = re.compile(r"^(?P<stem>(?:.*\.)?experts)\.(?P<expert>\d+)\.(?P<part>\w+)\.weight$")


@dataclass
class Source:
    """Tensor `key` of `file` is region `region` of its target; `squeezed`: stored without the
    target's leading (expert) dimension."""

    key: str
    file: str
    region: Region
    squeezed: bool = False


@dataclass
class Target:
    """A tensor under the module's name (without the prefix): its full shape, dtype and sources."""

    shape: Tuple[int, ...]
    dtype: str
    sources: List[Source] = field(default_factory=list)

    def file_names(self) -> List[str]:
        return [s.key for s in self.sources]


def _renamed(key: str) -> str:
    for old, new in RENAMES:
        key = key.replace(old, new)
    return key


def converted_name(key: str) -> Optional[str]:
    """The name transformers gives the file's tensor `key` on load, None when it keeps it."""
    m = PER_EXPERT.match(key)
    if m is not None and m["part"] in _FUSED_OF:
        return f"{_renamed(m['stem'])}.{_FUSED_OF[m['part']]}"
    new = _renamed(key)
    return None if new == key else new


def _fused(root, name: str, members: Dict[Tuple[int, str], Tuple[str, str, Tuple[int, ...], str]],
           shape: Optional[Tuple[int, ...]]) -> Target:
    """The target `name` (``...experts.gate_up_proj``) from its per-expert tensors; `shape`: the
    module's (its first dimension is the number of experts)."""
    fused = name.rsplit(".", 1)[1]
    present = {part for _, part in members}
    family = next((f for f in FUSED[fused] if present <= set(f)), None)
    if family is None:
        raise CheckpointError(f"{root}: the per-expert tensors of {name} mix names of different models "
                              f"({', '.join(sorted(present))}): load a directory of one model")
    some = next(iter(members.values()))[0]
    stem = some[:some.index(".experts.") + len(".experts.")]
    experts = max(1 + max(e for e, _ in members), shape[0] if shape else 0)
    lacking = [f"{stem}{e}.{part}.weight" for e in range(experts) for part in family if (e, part) not in members]
    if lacking:
        raise CheckpointError(f"{root}: {name} is stored per expert, and the directory lacks "
                              f"{', '.join(lacking[:4])}{', ...' if len(lacking) > 4 else ''}: copy the model's "
                              f"files completely (every expert's {' and '.join(family)})")
    shapes = {part: {members[(e, part)][2] for e in range(experts)} for part in family}
    odd = [part for part, s in shapes.items() if len(s) != 1 or len(next(iter(s))) != 2]
    if odd or len({next(iter(shapes[p]))[1] for p in family}) != 1:
        raise CheckpointError(f"{root}: the per-expert tensors of {name} ({stem}*.{{{','.join(family)}}}.weight) "
                              f"differ in shape from expert to expert or from each other "
                              f"({ {p: sorted(map(list, s)) for p, s in shapes.items()} }): load the directory of "
                              f"this model")
    rows = [next(iter(shapes[p]))[0] for p in family]
    cols = next(iter(shapes[family[0]]))[1]
    target = Target((experts, sum(rows), cols), members[(0, family[0])][3])
    for e in range(experts):
        at = 0
        for part, n in zip(family, rows):
            key, file, _, _ = members[(e, part)]
            target.sources.append(Source(key, file, ((e, e + 1), (at, at + n), (0, cols)), squeezed=True))
            at += n
    return target


def targets(root, files: Dict[str, Tuple[str, Tuple[int, ...], str]],
            module_keys: Dict[str, Tuple[int, ...]]) -> Dict[str, Target]:
    """The directory's tensors (name -> (file, shape, dtype)) under the module's names
    (`module_keys`: name, the prefix removed -> full shape): as they are, renamed, or fused from
    per-expert tensors."""
    out: Dict[str, Target] = {}
    groups: Dict[str, Dict[Tuple[int, str], tuple]] = {}
    for key, (file, shape, dtype) in files.items():
        new = None if key in module_keys else converted_name(key)
        if new is None or new not in module_keys:
            new = key
        m = PER_EXPERT.match(key)
        if new != key and m is not None and m["part"] in _FUSED_OF:
            groups.setdefault(new, {})[(int(m["expert"]), m["part"])] = (key, file, shape, dtype)
            continue
        if new in out:
            raise CheckpointError(f"{root} holds both {out[new].sources[0].key} and {key}, which are both "
                                  f"the module's {new}: keep one of them")
        out[new] = Target(shape, dtype, [Source(key, file, tuple((0, d) for d in shape))])
    for name, members in groups.items():
        if name in out:
            raise CheckpointError(f"{root} holds {name} both fused and per expert: keep one of them")
        out[name] = _fused(root, name, members, module_keys.get(name))
    return out
