"""The generated forward's input checks (`nnscaler.codegen.input_checks`), rendered and run alone."""
import pytest
import torch
import torch.nn as nn

from nnscaler.codegen.input_checks import input_checks
from nnscaler.ir import trace


class Pair(nn.Module):
    def forward(self, xs, ids):
        return (xs[0] + xs[1]).sum() + ids.float().sum()


ARGS = {"xs": [torch.randn(2, 3), torch.randn(2, 3)], "ids": torch.zeros(2, dtype=torch.int64)}


def _checker(folding):
    graph = trace(Pair(), ARGS, constant_folding=folding, both_modes=False)
    body = input_checks(graph)
    ns = {"torch": torch}
    exec("def check(xs, ids):\n" + "\n".join("    " + line for line in body) + "\n    return 'ok'\n", ns)
    return ns["check"]


def test_folded_schema_is_checked_per_leaf():
    check = _checker(True)
    assert check(**ARGS) == "ok"
    assert check([torch.randn(2, 3, dtype=torch.float64), ARGS["xs"][1]], ARGS["ids"]) == "ok"  # any float
    with pytest.raises(ValueError, match=r"^argument xs\[1\] has shape \(4, 3\), dtype float32, but .*\(2, 3\)"):
        check([ARGS["xs"][0], torch.randn(4, 3)], ARGS["ids"])
    with pytest.raises(ValueError, match=r"^argument ids has shape \(2,\), dtype int32, .*dtype int64:"):
        check(ARGS["xs"], torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"^argument ids has type list"):
        check(ARGS["xs"], [0, 0])


def test_unfolded_checks_only_the_rank():
    check = _checker(False)
    assert check([torch.randn(5, 7), torch.randn(5, 7)], torch.zeros(9, dtype=torch.int32)) == "ok"
    with pytest.raises(ValueError, match=r"^argument xs\[0\] has shape \(5,\), dtype float32, but the model was "
                                         r"traced with 2 dim\(s\) \(shape \(2, 3\)\)"):
        check([torch.randn(5), torch.randn(5, 7)], ARGS["ids"])
