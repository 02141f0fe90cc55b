"""Progress reports of autodist's measurements (nnscaler.policies.autodist.progress): what is
profiled (op kind and shapes, n of N) reaches the hook a trainer or CLI renders; with no hook, a
line per report on the logger (no terminal) or a rich bar (a terminal)."""
from __future__ import annotations

import io
import logging

import torch

import gpt
from nnscaler.ir import trace
from nnscaler.policies import ProfileProgress, progress_hook, set_progress_hook
from nnscaler.policies.autodist import progress
from nnscaler.policies.autodist.op_profile import profile_graph


def gpt_graph():
    cfg = gpt.GPTConfig(n_layer=2, n_embd=32, n_head=4, block_size=16, vocab_size=64)
    torch.manual_seed(0)
    return trace(gpt.GPT(cfg), gpt.random_batch(0, 2, cfg))


def test_each_profiled_op_is_reported_with_its_kind_and_shapes(tmp_path):
    seen = []
    graph = gpt_graph()
    with progress_hook(seen.append):
        _, db = profile_graph(graph, repeats=1, db_path=tmp_path / "p.json")
    ops = [p for p in seen if not p.finished]
    assert all(isinstance(p, ProfileProgress) and p.kind == "op" for p in seen)
    assert [p.done for p in ops] == list(range(1, db.misses + 1)) and {p.total for p in ops} == {db.misses}
    assert seen[-1].finished and seen[-1].done == seen[-1].total == db.misses
    linear = [p.label for p in ops if p.label.startswith("linear(")]
    assert linear and "(2, 16, 32) float32" in linear[0]  # the input's shape and dtype
    seen.clear()
    with progress_hook(seen.append):
        profile_graph(graph, repeats=1, db_path=tmp_path / "p.json")
    assert seen == []  # all cached: nothing to report


def test_the_hook_is_restored_after_the_block():
    mine = []
    assert set_progress_hook(None) is None
    with progress_hook(mine.append):
        with progress.task("graph", 1) as t:
            t.advance("the whole graph")
    assert set_progress_hook(None) is None
    assert [p.describe() for p in mine if not p.finished] == ["autodist: profiling graph 1/1: the whole graph"]


def test_without_a_hook_or_a_terminal_each_report_is_a_log_line(caplog):
    with caplog.at_level(logging.INFO, logger="nnscaler.policies.autodist"):
        with progress.task("op", 2) as t:
            t.advance("linear((4, 8) float32)")
            t.advance("gelu((4, 8) float32)")
    assert [r.getMessage() for r in caplog.records] == ["autodist: profiling op 1/2: linear((4, 8) float32)",
                                                        "autodist: profiling op 2/2: gelu((4, 8) float32)"]


def test_on_a_terminal_rich_draws_the_bar(monkeypatch, caplog):
    class Tty(io.StringIO):
        def isatty(self):
            return True

    err = Tty()
    monkeypatch.setattr("sys.stderr", err)
    monkeypatch.setenv("TERM", "xterm")
    monkeypatch.setenv("FORCE_COLOR", "1")
    with caplog.at_level(logging.INFO, logger="nnscaler.policies.autodist"):
        with progress.task("op", 2) as t:
            t.advance("linear((4, 8) float32)")
            t.advance("gelu((4, 8) float32)")
    assert not caplog.records  # drawn, not logged
    assert "autodist: profiling op" in err.getvalue()
