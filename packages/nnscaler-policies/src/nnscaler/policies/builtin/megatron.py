"""A hand-written Megatron-style policy for transformer blocks (the reference for good TP).

Column-parallel linears (split their output features, `n`) start a parallel region;
row-parallel linears (split their input features, `k`, giving value-split outputs) end it. Ops
in between follow the layout their input arrives in (split along the dim that is already split),
so the region runs without communication: per block, one all-reduce after attention and one
after the MLP in forward, and their duals (one each) in backward. Everything else (embeddings,
layer norms, the loss) is replicated.

    from nnscaler.policies.builtin.megatron import megatron_policy
    pm = parallelize(model, args, megatron_policy, ComputeConfig(2, 2))

Module globs choose the linears (defaults fit the example GPT: ``q_proj``/``k_proj``/``v_proj``
and ``c_fc`` are column-parallel, ``attn.c_proj`` and ``mlp.c_proj`` row-parallel); pass
``pas_config={'column': [...], 'row': [...]}`` to change them.
"""
from __future__ import annotations

import fnmatch

from ..plan import tensor_inputs
from ..registry import register_policy
from ._spread import dim_of_input_axis, replicate_over_unit, split_over_unit, splittable

COLUMN = ("*.q_proj", "*.k_proj", "*.v_proj", "*.c_fc")
ROW = ("*.attn.c_proj", "*.mlp.c_proj")


def _matches(path: str, globs) -> bool:
    return any(fnmatch.fnmatchcase(path, g) for g in globs)


@register_policy("megatron")
def megatron_policy(graph, compute_config):
    n = compute_config.plan_ngpus
    column = compute_config.pas_config.get("column", COLUMN)
    row = compute_config.pas_config.get("row", ROW)
    split_on = {}  # value id -> axis it is split along
    for node in graph.nodes:
        dim = None
        if n > 1 and node.short_name == "linear" and _matches(node.module_path, column):
            dim = "n"
        elif n > 1 and node.short_name == "linear" and _matches(node.module_path, row):
            dim = "k"
        elif n > 1:
            dim = _follow(graph, node, split_on, n)
        if dim is not None and dim in splittable(graph, node, n):
            split_over_unit(graph, node, dim, n)
            for ref, place in zip([r for r in node.output_refs() if graph.value(r).is_tensor],
                                  node.pieces[0].outputs):
                if getattr(place, "dim", None) is not None:
                    split_on[ref.id] = place.dim
        else:
            replicate_over_unit(graph, node, n)
    return graph


def _follow(graph, node, split_on, n):
    """The dim along which an input of `node` is already split, if the op can split along it."""
    for index, ref in enumerate(tensor_inputs(graph, node)):
        axis = split_on.get(ref.id)
        if axis is None:
            continue
        dim = dim_of_input_axis(graph, node, index, axis)
        if dim is not None and dim in splittable(graph, node, n):
            return dim
    return None
