"""`cp`: context parallelism. Every op is split along the sequence over the plan's devices;
attention becomes ring attention.

The sequence axis starts at the inputs (axis ``pas_config['sequence_dim']``, default 1, of every
input tensor with more dims than that: token ids, labels, masks, position ids) and follows the
ops: an op with an input split along the sequence is split along the annotated dim at that axis
when its annotation allows it (its outputs then carry the split), else replicated (the adapters
gather its inputs: a mask's key positions, a loss over the whole sequence, the shift of the
labels). Ops that read no sequence-split input (``arange`` positions, weights) are replicated and
their consumers take their slice for free. Every annotation being exact, the plan computes what
one process computes.

Each ``scaled_dot_product_attention`` gets pieces along `RING_DIM` (q, k, v and the mask's rows
split along the sequence, output likewise): the generated code calls ring attention
(``nnscaler.runtime.ring_attention``), which passes the key/value blocks around the devices and,
when causal, balances the rows (chunks i and 2N-1-i). The sequence must split into ``2N`` equal
chunks when causal (``N`` otherwise); attention dropout is refused. A model whose attention is
computed op by op (transformers' ``attn_implementation="eager"``) has no attention op to ring:
refused, naming its softmax and the fix.

A mixture-of-experts model: each routed-experts op is split over the devices as `ep` splits it (its
experts and tokens; ``pas_config['ep_size']`` 1 keeps every expert on every device), and the ops of
its block (router, shared experts) split along the sequence where they can follow it, else along
the batch as under `ep` (the flattened (B*S, H) tokens of a batch above 1), else whole.

An in-place write through a view (DeepSeek-V3's attention fills ``key = k.new_empty(...);
key[..., :8].copy_(k_nope)``), its views and their base are split along the sequence where every one
of them can follow it (`_cp_writes.py`: each rank writes its own rows of its piece of the base, nothing
gathered); otherwise they stay whole on every device, as under `tp` (`written_through_views`: split
another way, the write would land in a copy of the base's piece and be lost), their sequence-split
inputs gathered for them.

Keys: ``sequence_dim``, ``ep_size``; pipelines (``pp_size`` ...) and ``tp_modules`` as `ep`
(`_unit_plan.py`).
Data parallelism across units (``runtime_ngpus > plan_ngpus``), ZeRO and recomputation compose as
for every policy.
"""
from __future__ import annotations

from typing import Dict, Sequence

from nnscaler.ir import CROSS_ENTROPY, RING_DIM, ROUTED_EXPERTS, SDPA, SEQUENCE_LOSS_DIM, ConfigError, Replicate, Shard

from ..plan import Piece, PlanError, tensor_inputs, tensor_outputs
from ..registry import register_policy
from ._spread import replicate_over_unit, split_activation_batch_or_replicate, split_over_unit
from ._cp_rows import mask_row_splits
from ._cp_writes import SequenceWrites
from ._unit_plan import UNIT_KEYS, TensorParallelModules, devices_of, stage_if_asked
from .ep import ep_size_of, moe_blocks, split_routed_experts
from .megatron import follow_split

__all__ = ["cp", "split_ring", "split_loss"]


@register_policy("cp", keys=UNIT_KEYS | {"sequence_dim", "ep_size"}, pipelines=True)
def cp(graph, cfg):
    pas = dict(cfg.pas_config or {})
    axis = pas.get("sequence_dim", 1)
    if isinstance(axis, bool) or not isinstance(axis, int) or axis < 0:
        raise ConfigError(f"pas_config['sequence_dim'] must be the inputs' sequence axis (an int >= 0), got {axis!r}")
    if not any(n.target == SDPA for n in graph.nodes):
        raise PlanError(_no_attention(graph))
    pp_size = stage_if_asked(graph, cfg, "cp")
    ep_size = ep_size_of(pas, cfg.plan_ngpus // pp_size, "cp")
    blocks = moe_blocks(graph)  # mixture-of-experts modules: their tokens may split along the batch instead
    tp = TensorParallelModules(pas)
    writes = SequenceWrites(graph)  # in-place writes through views, with their views and base
    along: Dict[int, int] = {}  # value id -> the axis it is split along
    mask_rows: Dict[int, Dict[int, str]] = {}  # devices -> {node id: dim}: ops building a mask's rows
    for spec in graph.inputs:
        for _, ref in spec.leaves:
            value = graph.value(ref)
            if value.is_tensor and value.shape is not None and len(value.shape) > axis:
                along[ref.id] = axis
    for node in graph.nodes:
        devices = devices_of(graph, node, cfg.plan_ngpus)
        if len(devices) < 2:
            replicate_over_unit(graph, node, len(devices), devices)
            continue
        tp_dim = tp.dim(graph, node, devices)
        if node.target == SDPA:
            split_ring(graph, node, devices)
        elif node.target == CROSS_ENTROPY and split_loss(graph, node, along, devices):
            pass  # a mean loss over this rank's tokens, the sums all-reduced (no logits gathered)
        elif node.target == ROUTED_EXPERTS:
            split_routed_experts(graph, node, devices, ep_size)  # experts over the devices, as `ep`
        elif node.id in writes:  # along the sequence where the whole write can follow it, else whole
            if not writes.split(node, along, devices):
                replicate_over_unit(graph, node, len(devices), devices)
        elif tp_dim is not None:
            tp.split(graph, node, tp_dim, devices)
        else:
            dim = follow_split(graph, node, along, len(devices))  # an input's split axis, where the op splits it
            if dim is None:  # an op building an attention mask: its rows only (_cp_rows.py)
                if len(devices) not in mask_rows:
                    mask_rows[len(devices)] = mask_row_splits(graph, len(devices))
                dim = mask_rows[len(devices)].get(node.id)
            if dim is not None:
                split_over_unit(graph, node, dim, len(devices), devices)
            elif _in_blocks(node, blocks):  # a MoE block's (B, S, H) -> (B*S, H): split by the batch, as `ep`
                split_activation_batch_or_replicate(graph, node, devices)
            else:
                replicate_over_unit(graph, node, len(devices), devices)
        for ref, place in zip(tensor_outputs(graph, node), node.pieces[0].outputs):
            if isinstance(place, Shard):
                along[ref.id] = place.dim
    return graph


def _in_blocks(node, blocks) -> bool:
    path = node.module_path or ""
    return any(path == b or path.startswith(b + ".") for b in blocks)


def split_ring(graph, node, devices: Sequence[int]) -> None:
    """Piece i of attention op `node` on ``devices[i]``: rows i/n of q, k, v and the mask."""
    n = len(devices)
    ins = tensor_inputs(graph, node)
    q = graph.value(ins[0]).shape
    causal = _argument(node, "is_causal", 5)
    where = f"the attention {node.module_path or node.describe()}"
    dropout = _argument(node, "dropout_p", 4)
    if dropout:
        raise PlanError(f"{where} runs dropout_p={dropout}, which ring attention does not: set the model's attention "
                        f"dropout to 0 under pas_policy 'cp'")
    chunks = 2 * n if causal else n
    if q[-2] % chunks:
        raise PlanError(f"{where} has a sequence of {q[-2]} positions, which does not split into {chunks} equal "
                        f"chunks ({'2 x ' if causal else ''}the cp size {n}{': causal rows are balanced' if causal else ''}"
                        f"): make the sequence length a multiple of {chunks}")
    rows = [Shard(len(graph.value(r).shape) - 2) for r in ins[:3]]
    for ref in ins[3:]:  # the mask: its rows split, unless it broadcasts over them
        shape = graph.value(ref).shape
        rows.append(Shard(len(shape) - 2) if len(shape) >= 2 and shape[-2] != 1 else Replicate())
    outs = [Shard(len(graph.value(r).shape) - 2) for r in tensor_outputs(graph, node)]
    node.pieces = [Piece(i, n, list(rows), list(outs), RING_DIM, device) for i, device in enumerate(devices)]


def split_loss(graph, node, along: Dict[int, int], devices: Sequence[int]) -> bool:
    """Pieces of a mean ``cross_entropy`` whose input arrives split along its tokens (dim 0 of
    (N, C), or a dim >= 2 of (N, C, d1, ...)): input and target split alike, the mean whole on every
    piece (`SEQUENCE_LOSS_DIM`: ``nr.sequence_loss.cross_entropy``). False when it does not apply
    (another reduction: its annotation splits it; an unsplit input; a dim that does not split evenly)."""
    if (_argument(node, "reduction", 6) or "mean") != "mean" or _argument(node, "size_average", 3) is not None \
            or _argument(node, "reduce", 5) is not None:
        return False
    ins = tensor_inputs(graph, node)
    if len(ins) < 2 or ins[0].id not in along:
        return False
    x, target = graph.value(ins[0]).shape, graph.value(ins[1]).shape
    dim, n = along[ins[0].id], len(devices)
    if x is None or target is None or len(x) < 2 or dim == 1 or x[dim] % n:
        return False
    t_dim = dim if len(target) == len(x) or dim == 0 else dim - 1  # class probabilities: the input's shape
    places = [Shard(dim), Shard(t_dim)] + [Replicate()] * (len(ins) - 2)  # the class weights whole
    outs = [Replicate() for _ in tensor_outputs(graph, node)]
    node.pieces = [Piece(i, n, list(places), list(outs), SEQUENCE_LOSS_DIM, device) for i, device in enumerate(devices)]
    return True


def _argument(node, name: str, position: int):
    if name in node.kwargs:
        return node.kwargs[name]
    return node.args[position] if len(node.args) > position else None


def _no_attention(graph) -> str:
    softmax = [n for n in graph.nodes if n.short_name == "softmax"]
    seen = "; ".join(f"{n.target} at {n.source}" if n.source else n.describe() for n in softmax[:2])
    eager = f" It computes attention op by op ({seen}): ring attention needs it in one call." if softmax else ""
    return (f"pas_policy 'cp' found no torch.nn.functional.scaled_dot_product_attention in {graph.module_class}."
            f"{eager} For transformers models pass attn_implementation='sdpa' to the config / from_pretrained; "
            f"for your own attention call torch.nn.functional.scaled_dot_product_attention")
