"""Random ops in generated code: each draws from the runtime's stream (nnscaler.runtime.random).

`RandomOps(graph, cfg, unit)` is made once per rank module by `emit_rank`; `wrap(node, lines,
renderer)` rewrites the statement of a random op (others pass unchanged):

* ``rng_mode="parallel"``: an op whose output is replicated (or value-split) runs as traced (the
  default generator carries the module's stream, the same on the ranks of a unit); an op whose
  output is split across the unit runs under ``with nr.random.shard_stream(self, n):``.
* ``rng_mode="exact"``: a dropout is computed as ``x * piece(dropout(ones(full shape)))`` and a
  ``*_like`` factory as ``piece(factory(ones(full shape)))``, so every rank draws what the single
  device draws and keeps its piece (the tensor-parallel slice, plus, for values computed from the
  forward's inputs, its block of the global batch along dim 0). Other random ops run as traced
  where the rank holds the whole output and the draw does not depend on the batch; elsewhere they
  are refused, naming the user's line.
"""
from __future__ import annotations

from typing import Dict, List, Optional

from nnscaler.ir import ComputeConfig, IRGraph, LIKE, MASK, Node, Shard, node_random_kind

from .errors import GenerationError
from .render import ModeChoice, RawExpr, Renderer
from .branches import with_branch_args


def count_random_ops(graph: IRGraph) -> int:
    return sum(1 for node in graph.nodes if node_random_kind(node) is not None)


class _Call(RawExpr):
    """`nr.random.<fn>(self, <value>, shard=..., batch=...)` in generated code."""

    def __init__(self, fn: str, value, shard, batch: bool):
        self.fn, self.value, self.shard, self.batch = fn, value, shard, batch

    def render(self, renderer: Renderer) -> str:
        return (f"nr.random.{self.fn}(self, {renderer.value(self.value)}, shard={self.shard!r}, "
                f"batch={self.batch!r})")


def _where(node: Node) -> str:
    if node.source is None:
        return f"{node.target}" + (f" in module {node.module_path}" if node.module_path else "")
    mod = f" (module {node.module_path})" if node.module_path else ""
    return f"{node.target} at {node.source.file}:{node.source.line}{mod}: {node.source.code}"


class RandomOps:
    def __init__(self, graph: IRGraph, cfg: ComputeConfig, unit):
        self.graph, self.unit = graph, unit
        self.mode = cfg.rng_mode
        self.dp = cfg.dp_size
        self.nops = count_random_ops(graph)
        self._batch: Optional[set] = None
        if self.mode == "exact" and self.nops and graph.pipeline is not None:
            first = next(nd for nd in graph.nodes if node_random_kind(nd) is not None)
            raise GenerationError(
                f"ComputeConfig.rng_mode='exact' does not support pipelined plans yet (the stages draw in "
                f"schedule order, not in the single device's order), and the model has random ops, e.g. "
                f"{_where(first)}: use rng_mode='parallel', a plan without a pipeline, or dropout p=0")

    def class_attr(self) -> Dict[str, object]:
        """The generated class's RANDOM (identical on every rank)."""
        return {"mode": self.mode, "ops": self.nops}

    # -- helpers --------------------------------------------------------------------------------
    def _batch_values(self) -> tuple:
        """(tensors, values): ids of the tensors computed from the forward's input tensors (their
        dim 0 is taken as the batch; ints such as sizes do not carry it) and of every value that
        depends on the forward's inputs at all (ints included)."""
        if self._batch is None:
            tensors = {ref.id for inp in self.graph.inputs for _, ref in inp.leaves
                       if self.graph.value(ref).is_tensor}
            values = {ref.id for inp in self.graph.inputs for _, ref in inp.leaves}
            for node in self.graph.nodes:
                ins = node.input_refs()
                if any(r.id in values for r in ins):
                    values.update(r.id for r in node.output_refs())
                if any(r.id in tensors for r in ins):
                    tensors.update(r.id for r in node.output_refs() if self.graph.value(r).is_tensor)
            self._batch = (tensors, values)
        return self._batch

    def _placement(self, node: Node):
        for ref in node.output_refs():
            if self.graph.value(ref).is_tensor:
                return self.unit.produced.get(ref.id)
        needs = self.unit.needs.get(node.id) or []
        return needs[0].placement if needs else None

    def _shard(self, node: Node):
        placement = self._placement(node)
        if isinstance(placement, Shard):
            return (placement.dim, self.unit.plan_ngpus)
        return None

    # -- the rewrite ----------------------------------------------------------------------------
    def wrap(self, node: Node, lines: List[str], renderer: Renderer) -> List[str]:
        kind = node_random_kind(node)
        if kind is None:
            return lines
        shard = self._shard(node)
        if self.mode == "parallel":
            if shard is None:
                return lines
            return [f"with nr.random.shard_stream(self, {shard[1]}):"] + ["    " + line for line in lines]
        tensors, values = self._batch_values() if self.dp > 1 else (set(), set())
        batch = any(r.id in (tensors if kind in (MASK, LIKE) else values) for r in node.input_refs())
        if shard is None and not batch:
            return lines  # the rank draws the whole value, as the single device does
        if kind not in (MASK, LIKE):
            why = (f"its output is split over {shard[1]} devices" if shard is not None
                   else f"it draws for the batch of one of {self.dp} data-parallel replicas")
            raise GenerationError(
                f"ComputeConfig.rng_mode='exact' cannot reproduce the single-device draw of {_where(node)}: "
                f"{why}, and only dropout and rand_like / randn_like / randint_like can be drawn at the full "
                f"shape. Use rng_mode='parallel', keep this op replicated without data parallelism, or "
                f"draw it with F.dropout / torch.rand_like (attention: dropout_p=0, or softmax then F.dropout)")
        return [self._exact(node, kind, renderer, shard, batch)]

    def _exact(self, node: Node, kind: str, renderer: Renderer, shard, batch: bool) -> str:
        args, kwargs = list(node.args), dict(node.kwargs)
        if getattr(node, "branch_args", None):  # arguments that differ between branches (codegen/branches.py)
            args, kwargs = with_branch_args(node, args, kwargs)
        for where, key, train, eval_ in node.mode_args:
            (args if where == "args" else kwargs)[key] = ModeChoice(train, eval_)
        if args:
            x, args[0] = args[0], _Call("full_ones", args[0], shard, batch)
        elif "input" in kwargs:
            x, kwargs["input"] = kwargs["input"], _Call("full_ones", kwargs["input"], shard, batch)
        else:
            raise GenerationError(f"rng_mode='exact': cannot find the input tensor of {_where(node)}")
        inplace = False
        if kind == MASK:
            if "inplace" in kwargs:
                inplace, kwargs["inplace"] = kwargs["inplace"], False
            elif node.target.startswith("torch.nn.functional.") and len(args) > 3:
                inplace, args[3] = args[3], False
        full = renderer.call(node.target, args, kwargs)
        take = f"nr.random.piece(self, {full}, shard={shard!r}, batch={batch!r})"
        if kind == MASK:
            xs = renderer.value(x)
            expr = f"{xs}.mul_({take})" if inplace is True else f"{xs} * {take}"
        else:
            expr = take
        if node.outputs is None:
            return expr
        return f"{renderer.value(node.outputs)} = {expr}"
