"""Adapters: the collectives that turn a value from its producer's layout into its consumer's.

The table itself (`transition_steps`, `steps_cost`, `step_collectives`) lives in
`nnscaler.ir` (ir/transitions.py), so that policies (autodist's cost model) price the same steps codegen
emits; this module is codegen's name for it.
"""
from nnscaler.ir import (COST_MODELS, STEP_COLLECTIVES, CommCost, step_collectives,  # noqa: F401
                        steps_cost, transition_steps)

__all__ = ["transition_steps", "steps_cost", "step_collectives", "STEP_COLLECTIVES", "CommCost",
           "COST_MODELS"]
