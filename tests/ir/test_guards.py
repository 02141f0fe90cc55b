"""Value reads in the user's forward become guard nodes (nnscaler.ir.tracer.guards)."""
from __future__ import annotations

import inspect
import os
import warnings

import pytest
import torch
import torch.nn as nn

from nnscaler.ir import TracingWarning, trace
from nnscaler.ir.graph import IRGraph
from nnscaler.ir.tracer.guards import GUARD_TARGET, WHOLE_LIMIT, digest, guards_of

from guard_models import AssertMask


def line_of(fn, text):
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(lines) if text in line)


class Reads(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, n, big):
        k = n.max().item()  # item
        i = int(n[0])  # int
        f = float(x.sum())  # float
        listed = big.tolist()  # tolist of a large tensor: a digest
        small = n.tolist()  # tolist of a small one: the values
        return self.fc(x).sum() * k + i + f + len(listed) + len(small) + x.shape[0]


def _guards(graph: IRGraph):
    return [(g.kwargs["read"], g.kwargs["traced"]) for g in guards_of(graph)]


def test_bool_decision_is_a_guard_node_kept_in_program_order():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = trace(AssertMask(4), {"x": torch.randn(2, 4), "mask": torch.ones(2, 4)})
    targets = [n.target for n in g.nodes]
    # the comparison and all() feed nothing but the guard: dead-code elimination keeps them for it
    assert targets == ["torch.nn.functional.linear", "torch.Tensor.__eq__", "torch.Tensor.all", GUARD_TARGET,
                       "torch.Tensor.mul", "torch.Tensor.sum"]
    guard = g.nodes[3]
    assert guard.args == [g.nodes[2].outputs] and guard.outputs is None
    assert guard.kwargs["read"] == "bool" and guard.kwargs["traced"] is True
    assert guard.kwargs["cause"] == "forward's argument `mask`"
    assert "branches" not in guard.kwargs  # the other branch raises: it cannot be traced, so a guard
    assert guard.source.line == line_of(AssertMask.forward, "# assert line")
    assert os.path.basename(guard.source.file) == "guard_models.py"
    back = IRGraph.from_json(g.to_json())  # serialises like any op
    assert back.nodes[3].kwargs == guard.kwargs


def test_item_int_float_tolist_are_guarded_on_their_values():
    big = torch.arange(WHOLE_LIMIT + 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        x = torch.randn(2, 4)
        g = trace(Reads(), {"x": x, "n": torch.tensor([2, 5]), "big": big})
    reads = _guards(g)
    assert reads[:2] == [("item", 5), ("int", 2)]
    assert reads[2][0] == "float" and reads[2][1] == pytest.approx(float(x.sum()))
    assert reads[3] == ("tolist", {"digest": digest(big)})
    assert reads[4] == ("tolist", [2, 5])
    causes = [gd.kwargs["cause"] for gd in guards_of(g)]
    assert causes == ["forward's argument `n`", "forward's argument `n`", "forward's argument `x`",
                      "forward's argument `big`", "forward's argument `n`"]


def test_shapes_and_constants_are_not_guards_with_or_without_constant_folding():
    class Shapes(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = torch.tensor(3.0)  # a captured constant

        def forward(self, x):
            n = x.shape[0] * x.size(1)
            return x * n * float(self.scale)

    for folding in (False, True):
        g = trace(Shapes(), {"x": torch.randn(2, 3)}, constant_folding=folding)
        assert guards_of(g) == []
    with warnings.catch_warnings():  # a value read is guarded whatever constant_folding says
        warnings.simplefilter("ignore")
        g = trace(AssertMask(4), {"x": torch.randn(2, 4), "mask": torch.ones(2, 4)}, constant_folding=True)
    assert _guards(g) == [("bool", True)]


def test_warning_names_the_line_the_cause_and_what_happens_once_per_line():
    class Loop(nn.Module):
        def forward(self, x):
            for _ in range(3):
                assert (x > -100).all()  # checked three times, warned once
            return x * 2

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        g = trace(Loop(), {"x": torch.randn(2, 3)})
    ours = [w for w in caught if issubclass(w.category, TracingWarning)]
    assert len(ours) == 1 and len(guards_of(g)) == 3
    w = ours[0]
    assert (os.path.basename(w.filename), w.lineno) == ("test_guards.py", line_of(Loop.forward, "warned once"))
    msg = str(w.message)
    assert "bool(tensor)" in msg and "forward's argument `x`" in msg and "While tracing it was True" in msg
    assert "raises nnscaler.runtime.GuardError" in msg and "Trace with an example" in msg
    assert "pass it to forward as an argument" not in msg


def test_parameter_derived_value_names_the_parameters():
    class ParamRead(nn.Module):
        def __init__(self):
            super().__init__()
            self.temperature = nn.Parameter(torch.tensor(2.0))

        def forward(self, x):
            return x / self.temperature.item()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = trace(ParamRead(), {"x": torch.randn(2)})
    (guard,) = guards_of(g)
    assert guard.kwargs["read"] == "item" and guard.kwargs["traced"] == 2.0
    assert "temperature" in guard.kwargs["cause"] and "change as it trains" in guard.kwargs["cause"]


def test_library_line_and_the_models_line_for_hugging_face():
    transformers = pytest.importorskip("transformers")  # a test dependency; always installed here
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.LlamaModel(cfg)
    ids = torch.randint(0, 64, (2, 6))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        g = trace(model, {"input_ids": ids, "attention_mask": torch.ones(2, 6, dtype=torch.long), "use_cache": False})
    first = guards_of(g)[0]
    assert os.path.basename(first.source.file) == "masking_utils.py"
    assert "modeling_llama.py" in first.kwargs["via"] and "create_causal_mask" in first.kwargs["via"]
    assert first.kwargs["cause"] == "forward's argument `attention_mask`"
    fingerprint = g.fingerprint()  # like source lines, the library caller's line does not identify the program
    first.kwargs["via"] = "elsewhere.py:1"
    assert g.fingerprint() == fingerprint
    msg = next(str(w.message) for w in caught if issubclass(w.category, TracingWarning)
               and "masking_utils.py" in w.filename)
    assert "called from the model's line" in msg and "modeling_llama.py" in msg


def test_hugging_face_packed_sequence_check_generates_both_branches_and_says_so_once():
    """Without an attention mask, transformers 5 decides in Python whether the position ids pack
    several sequences (masking_utils.find_packed_sequence_indices): a value made from shapes alone.
    Both branches are generated (no GuardError when packed position ids come), and the warning says
    once what that means."""
    transformers = pytest.importorskip("transformers")  # a test dependency; always installed here
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        g = trace(transformers.LlamaModel(cfg), {"input_ids": torch.randint(0, 64, (2, 6)), "use_cache": False})
    (guard,) = guards_of(g)
    assert guard.source.function == "find_packed_sequence_indices" and guard.kwargs.get("branches") is True
    ours = [w for w in caught if issubclass(w.category, TracingWarning)]
    assert len(ours) == 1, [str(w.message) for w in ours]
    shown = warnings.formatwarning(ours[0].message, ours[0].category, ours[0].filename, ours[0].lineno)
    assert "both branches are generated" in shown and "only from shapes and constants" in shown
    assert shown.count("packed_sequence_mask[:, -1] == 0") == 1, shown
