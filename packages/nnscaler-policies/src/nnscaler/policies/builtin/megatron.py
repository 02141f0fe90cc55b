"""A hand-written Megatron-style policy for transformer blocks (the reference for good TP).

Column-parallel projections (split their output features, `n`) start a parallel region;
row-parallel projections (split their input features, `k`, giving value-split outputs) end it.
Ops in between follow the layout their input arrives in (split along the dim that is already
split), so the region runs without communication: per block, one all-reduce after attention and
one after the MLP in forward, and their duals (one each) in backward. Everything else
(embeddings, layer norms, the loss) is replicated.

    from nnscaler.policies.builtin.megatron import megatron_policy
    pm = parallelize(model, args, megatron_policy, ComputeConfig(2, 2))

A projection is an `nn.Linear` (``F.linear``) or Hugging Face's `Conv1D` (``torch.addmm``).
Module globs choose them; the defaults fit our example GPT, Hugging Face GPT-2, Llama (and its
relatives Qwen2 / Mistral), BERT and ViT (see `COLUMN`, `ROW`, `HEADS` and docs/megatron.md).
Pass ``pas_config={'column': [...], 'row': [...], 'heads': [...]}`` to change them.
"""
from __future__ import annotations

import fnmatch

from nnscaler.ir import warn_user

from ..plan import tensor_inputs, tensor_outputs
from ..registry import register_policy
from ._nothing_split import PolicyWarning
from ._spread import dim_of_input_axis, replicate_over_unit, split_over_unit, splittable

__all__ = ["COLUMN", "ROW", "HEADS", "MegatronPatternWarning", "megatron_policy", "megatron_dim", "megatron_globs",
           "note_split", "follow_split"]

COLUMN = (
    "*.q_proj", "*.k_proj", "*.v_proj", "*.c_fc",  # example GPT, GPT-2 MLP, Llama attention
    "*.gate_proj", "*.up_proj",  # Llama / Qwen2 / Mistral MLP
    "*.self.query", "*.self.key", "*.self.value",  # BERT attention
    "*.attention.attention.query", "*.attention.attention.key", "*.attention.attention.value",  # ViT (4.x)
    "*.intermediate.dense",  # BERT / ViT (4.x) MLP
    "*.mlp.fc1",  # ViT (5.x), CLIP
)
ROW = (
    "*.attn.c_proj", "*.mlp.c_proj",  # example GPT, GPT-2
    "*.o_proj", "*.down_proj",  # Llama
    "*.output.dense",  # BERT / ViT (4.x): attention output and MLP output
    "*.mlp.fc2",  # ViT (5.x), CLIP
)
# Attention modules whose q/k/v come out of one fused projection (GPT-2's `c_attn`): the fused
# projection stays replicated and the `view` that splits q, k, v into heads is split by heads.
HEADS = ("*.attn",)

_PROJECTIONS = ("linear", "addmm")


class MegatronPatternWarning(PolicyWarning):
    """A `megatron` pattern (``pas_config['column' | 'row' | 'heads']``) that matches no module
    of the model, or a plan that splits no projection at all. The message names the patterns and
    the module paths the model has."""


def _matches(path: str, globs) -> bool:
    return any(fnmatch.fnmatchcase(path, g) for g in globs)


@register_policy("megatron", keys=("column", "row", "heads"))
def megatron_policy(graph, compute_config):
    n = compute_config.plan_ngpus
    pas = compute_config.pas_config
    globs = megatron_globs(pas)
    split_on = {}  # value id -> axis it is split along
    projections = 0
    for node in graph.nodes:
        dim = megatron_dim(graph, node, n, globs, split_on) if n > 1 else None
        if dim is not None:
            split_over_unit(graph, node, dim, n)
            projections += _is_projection(node) and dim in ("n", "k")
            note_split(graph, node, split_on)
        else:
            replicate_over_unit(graph, node, n)
    if n > 1:
        _warn_unmatched(graph, pas, *globs, projections)
    return graph


def megatron_globs(pas) -> tuple:
    """(column, row, heads) module globs: ``pas_config``'s, else the defaults."""
    return tuple(tuple(pas.get(key, default)) for key, default in (("column", COLUMN), ("row", ROW), ("heads", HEADS)))


def _is_projection(node) -> bool:
    return node.short_name in _PROJECTIONS and node.target.startswith(("torch.",))


def megatron_dim(graph, node, n, globs, split_on):
    """The dim Megatron's rule splits `node` along over `n` devices (None: replicate it):
    column / row projections by module glob, other ops follow an input already split (`split_on`:
    value id -> axis), a view to heads in a `heads` module splits the heads."""
    column, row, heads = globs
    projection = _is_projection(node)
    if projection and _matches(node.module_path, column):
        dim = "n"
    elif projection and _matches(node.module_path, row):
        dim = "k"
    else:
        dim = follow_split(graph, node, split_on, n)
        if dim is None and _matches(node.module_path, heads):
            dim = _heads_dim(graph, node, n)
    return dim if dim is not None and dim in splittable(graph, node, n) else None


def note_split(graph, node, split_on) -> None:
    """Record along which axis each output of the (split) `node` is split, for `megatron_dim`."""
    for ref, place in zip([r for r in node.output_refs() if graph.value(r).is_tensor], node.pieces[0].outputs):
        if getattr(place, "dim", None) is not None:
            split_on[ref.id] = place.dim


def follow_split(graph, node, split_on, n):
    """The dim along which an input of `node` is already split, if the op can split along it."""
    for index, ref in enumerate(tensor_inputs(graph, node)):
        axis = split_on.get(ref.id)
        if axis is None:
            continue
        dim = dim_of_input_axis(graph, node, index, axis)
        if dim is not None and dim in splittable(graph, node, n):
            return dim
    return None


def _heads_dim(graph, node, n):
    """For a ``view`` / ``reshape`` that splits the last dim into (heads, head_dim): the dim of
    the heads, when it splits evenly."""
    if node.short_name not in ("view", "reshape"):
        return None
    ins, outs = tensor_inputs(graph, node), tensor_outputs(graph, node)
    if len(ins) != 1 or len(outs) != 1:
        return None
    before, after = graph.value(ins[0]).shape, graph.value(outs[0]).shape
    if before is None or after is None or len(after) != len(before) + 1 \
            or tuple(after[:len(before) - 1]) != tuple(before[:-1]):
        return None
    dim = dim_of_input_axis(graph, node, 0, len(before) - 1)
    return dim if dim is not None and dim in splittable(graph, node, n) else None


def _module_paths(graph):
    paths = sorted({node.module_path for node in graph.nodes if node.module_path})
    projections = sorted({node.module_path for node in graph.nodes
                          if node.module_path and node.short_name in _PROJECTIONS})
    return paths, projections


def _warn_unmatched(graph, pas, column, row, heads, projections) -> None:
    paths, proj_paths = _module_paths(graph)
    shown = ", ".join(proj_paths[:12]) + (f", … ({len(proj_paths)} in all)" if len(proj_paths) > 12 else "")
    for key, globs in (("column", column), ("row", row), ("heads", heads)):
        if key not in pas:
            continue  # the defaults cover several model families: most of them match nothing here
        unmatched = [g for g in globs if not any(fnmatch.fnmatchcase(p, g) for p in paths)]
        if unmatched:
            warn_user(f"megatron: pas_config['{key}'] pattern(s) {unmatched} match no module of the model; "
                      f"its projection modules (nn.Linear / Conv1D) are: {shown or 'none'}. Fix the globs "
                      f"(fnmatch on the module path, e.g. '*.attn.q_proj').", MegatronPatternWarning)
    if projections == 0:
        warn_user(f"megatron: the plan splits no projection (column patterns {list(column)}, row patterns "
                  f"{list(row)} match none of the model's projection modules: {shown or 'none'}); every "
                  f"parameter is replicated. Pass pas_config={{'column': [...], 'row': [...]}} with globs "
                  f"of the model's module paths.", MegatronPatternWarning)
