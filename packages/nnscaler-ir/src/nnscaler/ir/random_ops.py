"""The random ops of a traced graph, by target name (see nnscaler.runtime.random).

Codegen makes every op listed here draw from the runtime's stream. `kind` says how the exact mode
(`ComputeConfig.rng_mode == "exact"`) reproduces the single-device draw when a rank holds only a
piece of the op's output:

* ``mask``: a dropout whose output is ``input * noise`` (noise drawn at the input's shape): the
  full-shape noise is ``op(ones(full shape))`` and the rank multiplies its input by its piece;
* ``like``: a ``*_like`` factory drawing at its first argument's shape: drawn at the full shape,
  the rank keeps its piece;
* ``other``: the draw depends on values or shapes the rank does not have (``torch.rand(shape)``,
  ``bernoulli(p)``, alpha dropout, in-place fills): the exact mode runs it as is only where the
  rank holds the whole output and there is no data parallelism, and refuses it elsewhere.
"""
from __future__ import annotations

from typing import Optional

MASK, LIKE, OTHER = "mask", "like", "other"

_F = "torch.nn.functional."
RANDOM_OPS = {
    **{_F + n: MASK for n in ("dropout", "dropout1d", "dropout2d", "dropout3d")},
    "torch.dropout": MASK, "torch.feature_dropout": MASK,
    "torch.rand_like": LIKE, "torch.randn_like": LIKE, "torch.randint_like": LIKE,
    **{_F + n: OTHER for n in ("alpha_dropout", "feature_alpha_dropout", "rrelu", "gumbel_softmax")},
    **{"torch." + n: OTHER for n in ("alpha_dropout", "feature_alpha_dropout", "rand", "randn", "randint",
                                     "randperm", "normal", "bernoulli", "multinomial", "poisson", "rrelu")},
    **{"torch.Tensor." + n: OTHER for n in ("bernoulli", "bernoulli_", "uniform_", "normal_", "random_",
                                            "exponential_", "geometric_", "cauchy_", "log_normal_",
                                            "multinomial")},
}


def random_kind(target: str) -> Optional[str]:
    """`mask`, `like` or `other` for a random op's target name, None for any other op."""
    return RANDOM_OPS.get(target)
