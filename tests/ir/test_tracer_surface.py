"""The tracer's public surface (nnscaler.ir.tracer.surface.TracerSurface): `Tracer` implements all
of it, and no module but the recorder touches a private name of a tracer."""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch

import nnscaler.ir
from nnscaler.ir.tracer import tracing_context
from nnscaler.ir.tracer.recorder import Tracer
from nnscaler.ir.tracer.surface import TracerSurface
from nnscaler.ir.tracer.trace_device import ExecutionDevice

IR = Path(nnscaler.ir.__file__).parent
MEMBERS = [n for n in vars(TracerSurface) if not n.startswith("_")] + list(TracerSurface.__annotations__)


def test_every_member_of_the_surface_is_implemented_with_its_parameters():
    tracer = Tracer(torch.nn.Linear(2, 2), False, ExecutionDevice("cpu"))
    assert isinstance(tracer, TracerSurface)
    for name in MEMBERS:
        assert hasattr(tracer, name), name
        declared = getattr(TracerSurface, name, None)
        if callable(declared):
            ours = inspect.signature(getattr(Tracer, name))
            assert list(ours.parameters) == list(inspect.signature(declared).parameters), name


def test_the_surface_has_what_the_helpers_used_through_private_names():
    assert {"add_node", "to_refs", "wrap_outputs", "is_bound", "module_path", "function_grad",
            "next_decision"} <= set(MEMBERS)


def test_the_running_tracer_answers_through_the_surface():
    seen = {}

    class Probe(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = torch.nn.Linear(4, 4)

        def forward(self, x):
            tracer = tracing_context.current_tracer()
            seen["surface"] = isinstance(tracer, TracerSurface)
            seen["inner"] = tracer.module_path(self.inner)
            seen["outside"] = tracer.module_path(torch.nn.Linear(1, 1))
            seen["bound"] = tracer.is_bound(x)
            seen["decisions"] = [tracer.next_decision(), tracer.next_decision()]
            return self.inner(x)

    nnscaler.ir.trace(Probe(), {"x": torch.randn(2, 4)}, both_modes=False)
    assert seen == {"surface": True, "inner": "inner", "outside": None, "bound": True, "decisions": [0, 1]}


# ------------------------------------------------- nothing outside the recorder uses private names


def private_tracer_uses(source: str):
    """(line, text) of every ``<...tracer>._name`` read (not a dunder) in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
            continue
        owner = node.value
        name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else ""
        if name.lstrip("_").endswith("tracer"):
            found.append((node.lineno, ast.unparse(node)))
    return sorted(found)


def test_the_checker_finds_private_uses():
    source = "def f(tracer, self):\n    tracer._add_node(1)\n    self.tracer._to_refs(2)\n    x = self._tracer._ref\n"
    assert private_tracer_uses(source) == [(2, "tracer._add_node"), (3, "self.tracer._to_refs"),
                                           (4, "self._tracer._ref")]
    assert private_tracer_uses("def f(tracer):\n    tracer.add_node(1)\n    tracer.__class__\n") == []


@pytest.mark.parametrize("path", sorted(p for p in IR.rglob("*.py") if p.name != "recorder.py"),
                         ids=lambda p: str(p.relative_to(IR)))
def test_no_module_but_the_recorder_uses_a_private_name_of_the_tracer(path: Path):
    assert private_tracer_uses(path.read_text(encoding="utf-8")) == []
