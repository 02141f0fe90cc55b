"""The random ops of a traced graph, by target name (see nnscaler.runtime.random).

Codegen makes every op listed here draw from the runtime's stream. `kind` says how the exact mode
(`ComputeConfig.rng_mode == "exact"`) reproduces the single-device draw when a rank holds only a
piece of the op's output:

* ``mask``: a dropout whose output is ``input * noise`` (noise drawn at the input's shape): the
  full-shape noise is ``op(ones(full shape))`` and the rank multiplies its input by its piece;
* ``like``: a ``*_like`` factory drawing at its first argument's shape: drawn at the full shape,
  the rank keeps its piece;
* ``other``: the draw depends on values or shapes the rank does not have (``torch.rand(shape)``,
  ``bernoulli(p)``, alpha dropout, in-place fills, attention with ``dropout_p > 0``): the exact mode runs it as is only where the
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
    **{_F + n: OTHER for n in ("alpha_dropout", "feature_alpha_dropout", "rrelu", "gumbel_softmax",
                               "fractional_max_pool2d", "fractional_max_pool3d")},
    **{"torch." + n: OTHER for n in ("alpha_dropout", "feature_alpha_dropout", "rand", "randn", "randint",
                                     "randperm", "normal", "bernoulli", "multinomial", "poisson", "rrelu")},
    **{"torch.Tensor." + n: OTHER for n in ("bernoulli", "bernoulli_", "uniform_", "normal_", "random_",
                                            "exponential_", "geometric_", "cauchy_", "log_normal_",
                                            "multinomial")},
}


# Random only with a non-zero dropout_p (argument index, keyword).
_DROPOUT_P = {"torch.nn.functional.scaled_dot_product_attention": (4, "dropout_p")}


def random_kind(target: str) -> Optional[str]:
    """`mask`, `like` or `other` for a random op's target name, None for any other op."""
    return RANDOM_OPS.get(target)


def is_random_call(target: str, args, kwargs) -> bool:
    """Whether a call of `target` with these arguments draws random numbers (attention only with a
    non-zero ``dropout_p``)."""
    if target in RANDOM_OPS:
        return True
    if target not in _DROPOUT_P:
        return False
    index, key = _DROPOUT_P[target]
    p = kwargs[key] if key in kwargs else args[index] if len(args) > index else 0.0
    return not isinstance(p, (int, float)) or p != 0


def node_random_kind(node) -> Optional[str]:
    """`random_kind` of a traced op, plus ``other`` for attention with dropout (SDPA with a
    ``dropout_p`` that is not 0 in the traced mode or the other one)."""
    kind = RANDOM_OPS.get(node.target)
    if kind is not None or node.target not in _DROPOUT_P:
        return kind
    index, key = _DROPOUT_P[node.target]
    values = [node.kwargs[key] if key in node.kwargs else node.args[index] if len(node.args) > index else 0.0]
    values += [v for _, k, train, eval_ in node.mode_args if k in (index, key) for v in (train, eval_)]
    return OTHER if any(not isinstance(v, (int, float)) or v != 0 for v in values) else None
