"""Ops whose pieces communicate inside: the runtime's version is called where the plan splits
them in a way no annotation can express.

- expert parallelism: a routed-experts op (``nnscaler.ir.ops.moe``) split along ``e``
  (`EXPERT_DIM`; piece i holds 1/n of the tokens and of the experts: the index holds global
  expert ids) calls ``nr.moe.expert_parallel``, which exchanges the tokens by all-to-all; split
  along ``e:k`` (`expert_group_dim`: stored as along ``e``, the tokens exchanged inside groups of
  k consecutive devices of the unit) it passes ``ep_size=k`` (the process groups of the groups and
  of their replica sets, the devices at one group position, are made with the unit's, `expert_groups`);
- context parallelism: ``scaled_dot_product_attention`` split along `RING_DIM` (piece i holds 1/n
  of the sequence of q, k, v and the mask's rows) calls ``nr.ring_attention.attention``; a mean
  ``cross_entropy`` split along `SEQUENCE_LOSS_DIM` (piece i holds 1/n of the tokens, the mean is
  whole on every piece) calls ``nr.sequence_loss.cross_entropy``.

`collective_call` rewrites the op's statement ``y = <target>(args...)`` to ``y = <runtime
call>(args..., ranks=(...))`` with the ranks of the unit (or of the pipeline stage); expert
parallelism also gets ``layer=<the experts module's path>`` (its key in the expert-load record).
"""
from __future__ import annotations

from typing import List, Optional

from nnscaler.ir import CROSS_ENTROPY, EXPERT_DIM, RING_DIM, ROUTED_EXPERTS, SDPA, SEQUENCE_LOSS_DIM, Node, expert_group

from .errors import GenerationError
from .layouts import UnitPlan

__all__ = ["collective_call", "runtime_call", "expert_groups", "RUNTIME_CALLS"]

RUNTIME_CALLS = {(ROUTED_EXPERTS, EXPERT_DIM): "nr.moe.expert_parallel",
                 (SDPA, RING_DIM): "nr.ring_attention.attention",
                 (CROSS_ENTROPY, SEQUENCE_LOSS_DIM): "nr.sequence_loss.cross_entropy"}


def runtime_call(node: Node, unit: UnitPlan) -> Optional[str]:
    """The runtime function that runs `node`'s pieces, or None when the op runs as traced."""
    if not unit.partitioned.get(node.id) or not node.pieces:
        return None
    experts, _ = expert_group(node.pieces[0].dim)  # "e:k": the experts over groups of k devices
    return RUNTIME_CALLS.get((node.target, EXPERT_DIM if experts else node.pieces[0].dim))


def expert_groups(nodes) -> set:
    """The group sizes k of the routed-experts ops split over groups of k devices (``"e:k"`` pieces)."""
    out = set()
    for node in nodes:
        if node.target == ROUTED_EXPERTS and node.pieces:
            experts, k = expert_group(node.pieces[0].dim)
            if experts and k is not None:
                out.add(k)
    return out


def collective_call(node: Node, lines: List[str], unit: UnitPlan, ranks: tuple) -> List[str]:
    """`lines` (the op's statement) calling the runtime's version over `ranks` where the plan asks."""
    call = runtime_call(node, unit)
    if call is None:
        return lines
    target = node.target + "("
    if len(lines) != 1 or lines[0].count(target) != 1 or not lines[0].endswith(")"):
        raise GenerationError(f"cannot rewrite the op {node.describe()} to {call} (generated as {lines!r})")
    extra = ""
    if call == RUNTIME_CALLS[(ROUTED_EXPERTS, EXPERT_DIM)]:
        _, group = expert_group(node.pieces[0].dim)
        extra = f", layer={(node.module_path or f'op {node.id}')!r}" + (f", ep_size={group}" if group else "")
    return [lines[0].replace(target, call + "(")[:-1] + f", ranks={tuple(ranks)!r}{extra})"]
