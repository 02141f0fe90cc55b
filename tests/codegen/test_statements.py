"""One op's statements (codegen/statements.py): sizes read of a split value are full sizes, also
when the value differs between the branches of a decision and the plan splits each side along
another dim (issue 45: tp on a padded Llama batch read the heads' size as the batch's)."""
from __future__ import annotations

import ast
import warnings

import torch
import torch.nn as nn

from nnscaler.codegen.emit import emit_rank
from nnscaler.ir import ComputeConfig, trace
from nnscaler.policies import apply_policy, assign, partition, replicate
from nnscaler.policies.primitives import bind_annotation

from guard_models import fast_all


class ShapeOfBranchValue(nn.Module):
    """`y` comes from one of two branches; its shape is read and spelled into a reshape."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, mask):
        h = self.fc(x)
        if fast_all(mask):
            y = h * 2
        else:
            y = h * mask[..., None]
        b, s, d = y.shape
        return y.reshape(b * s, d).sum()


def _split_sides_differently(graph, config):
    """The unmasked side's product split along the batch (dim 0), the masked side's along the
    sequence (dim 1); everything else replicated."""
    for node in graph.nodes:
        if node.branch is not None and node.target == "torch.Tensor.mul":
            dims = bind_annotation(graph, node).splittable_dims(2)
            pieces = partition(graph, node, dims[0] if node.branch[1] else dims[1], 2)
        else:
            pieces = replicate(graph, node, 2)
        for device, piece in enumerate(pieces):
            assign(piece, device)
    return graph


def test_sizes_of_a_value_split_differently_per_branch_are_scaled_per_branch():
    config = ComputeConfig(2, 2, trace_strategy="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = trace(ShapeOfBranchValue(), {"x": torch.randn(2, 4, 4),
                                             "mask": torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])})
    graph = apply_policy(graph, config, _split_sides_differently)
    text = emit_rank(graph, config.to_dict(), 0, _split_sides_differently, graph.fingerprint())
    forward = next(n for n in ast.walk(ast.parse(text)) if isinstance(n, ast.FunctionDef) and n.name == "_forward_impl")
    # `(b, s, d) = (y_true if _branch_N else y_false).shape`, then the ifs that scale its sizes
    at = next(i for i, st in enumerate(forward.body) if isinstance(st, ast.Assign)
              and isinstance(st.value, ast.Attribute) and st.value.attr == "shape" and isinstance(st.value.value, ast.IfExp))
    read = forward.body[at]
    choice = read.value.value
    decision, when_true, when_false = choice.test.id, choice.body.id, choice.orelse.id
    names = [target.id for target in read.targets[0].elts]
    block = [read]
    for st in forward.body[at + 1:]:
        if not (isinstance(st, ast.If) and decision in {n.id for n in ast.walk(st.test) if isinstance(n, ast.Name)}):
            break
        block.append(st)
    code = compile(ast.Module(body=block, type_ignores=[]), "gencode0.py", "exec")
    local = {True: torch.zeros(1, 4, 4), False: torch.zeros(2, 2, 4)}  # rank 0's piece: split along dim 0 / dim 1
    for side in (True, False):
        scope = {decision: side, when_true: local[True], when_false: local[False]}
        exec(code, {}, scope)
        assert tuple(scope[n] for n in names) == (2, 4, 4), (side, ast.unparse(ast.Module(body=block, type_ignores=[])))
