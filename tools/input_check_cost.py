"""The cost per forward call of the generated input checks (nnscaler.codegen.input_checks).

Traces a model with one tensor argument and one nested dict of two tensors, renders the checks the
generated forward starts with (constant folding on: shape + dtype; off: rank + floating or not; the
Python scalar `scale`: its value), and times them alone
against an empty function of the same signature. Run: ``python tools/input_check_cost.py``.
"""
import timeit

import torch
import torch.nn as nn

from nnscaler.codegen.input_checks import input_checks
from nnscaler.ir import trace


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x, batch, scale=2.0):
        return self.fc(x).sum() * scale + batch["a"].sum() * batch["b"].sum()


def main():
    args = {"x": torch.randn(4, 16), "batch": {"a": torch.randn(4, 3), "b": torch.randn(4)}}
    n = 200_000
    for folding in (True, False):
        graph = trace(Model(), args, constant_folding=folding, both_modes=False)
        body = input_checks(graph)
        src = "def check(x, batch, scale=2.0):\n" + "\n".join("    " + line for line in body) + "\n    return None\n"
        src += "def empty(x, batch, scale=2.0):\n    return None\n"
        ns = {"torch": torch}
        exec(src, ns)
        t_check = min(timeit.repeat(lambda: ns["check"](**args), number=n, repeat=5)) / n
        t_empty = min(timeit.repeat(lambda: ns["empty"](**args), number=n, repeat=5)) / n
        per = (t_check - t_empty) / 4
        print(f"constant_folding={folding}: {len(body) // 2} checks (3 tensors, 1 scalar), "
              f"{(t_check - t_empty) * 1e6:.2f} us per call ({per * 1e6:.2f} us per argument)")


if __name__ == "__main__":
    main()
