"""autodist's profile cache (nnscaler.policies.autodist.op_profile): where it lives, what its keys
depend on (the op's kind, shapes, dtypes and the machine; never its name, position or the graph's
size), identical ops measured once, and a deeper model of the same widths measuring nothing new.
Measurements are counted, never timed."""
from __future__ import annotations

import torch

import gpt
from nnscaler.ir import trace
from nnscaler.policies.autodist import cpu_sharing, graph_timing, op_profile
from nnscaler.policies.autodist.op_profile import ProfileDB, cache_dir, device_key, mix_key, profile_graph


def gpt_graph(n_layer, n_embd=32):
    cfg = gpt.GPTConfig(n_layer=n_layer, n_embd=n_embd, n_head=4, block_size=16, vocab_size=64)
    torch.manual_seed(0)
    return trace(gpt.GPT(cfg), gpt.random_batch(0, 2, cfg))


class _Counted:
    """Wraps a module's function and counts its calls."""

    def __init__(self, monkeypatch, module, name, replacement=None):
        self.calls = 0
        original = getattr(module, name)

        def counted(*args, **kwargs):
            self.calls += 1
            return (replacement or original)(*args, **kwargs)
        monkeypatch.setattr(module, name, counted)


def _signatures(graph):
    known = op_profile.int_values(graph)
    return [op_profile._key(graph, n, known) for n in graph.nodes if op_profile._profiled(graph, n)]


def test_identical_ops_are_profiled_once(tmp_path, monkeypatch):
    measured = _Counted(monkeypatch, op_profile, "_measure")
    graph = gpt_graph(2)
    sigs = _signatures(graph)
    times, db = profile_graph(graph, repeats=1, db_path=tmp_path / "p.json")
    assert len(set(sigs)) < len(sigs)  # the second layer repeats the first one's ops
    assert measured.calls == db.misses == len(set(sigs))
    assert db.hits == len(sigs) - len(set(sigs)) and len(times) == len(sigs)


def test_a_deeper_model_of_the_same_widths_profiles_nothing_new(tmp_path, monkeypatch):
    monkeypatch.setenv(cpu_sharing.ENV, "measure")
    ops = _Counted(monkeypatch, op_profile, "_measure")
    whole = _Counted(monkeypatch, graph_timing, "graph_seconds", lambda graph, device="cpu": 0.01)
    sharing = _Counted(monkeypatch, cpu_sharing, "_alone_and_busy", lambda graph, device, peers: (1.0, 2.2))
    adam = _Counted(monkeypatch, op_profile, "_adam_seconds")
    path = tmp_path / "p.json"

    def search_measurements(graph):
        times, db = profile_graph(graph, repeats=1, db_path=path)
        graph_timing.calibration(graph, times, db, "cpu")
        cpu_sharing.cpu_scale(graph, db, "cpu", procs=2 * cpu_sharing.shared_cores(), threads=1)
        shapes = [graph.value(s.value).shape or () for s in graph.tensor_specs() if s.requires_grad]
        op_profile.optimizer_rate(db, "cpu", False, shapes)
        return db

    search_measurements(gpt_graph(2))
    first = (ops.calls, whole.calls, sharing.calls, adam.calls)
    assert all(first)  # each was measured on the first model
    entries = set(ProfileDB(path).entries)
    db = search_measurements(gpt_graph(4))
    assert (ops.calls, whole.calls, sharing.calls, adam.calls) == first  # nothing measured again
    assert db.misses == 0 and db.hits == len(_signatures(gpt_graph(4)))
    assert set(ProfileDB(path).entries) == entries
    # other widths are other ops
    db = search_measurements(gpt_graph(2, n_embd=64))
    assert ops.calls > first[0] and whole.calls == 2 and sharing.calls == 2 and db.misses > 0


def test_the_keys_ignore_names_and_positions():
    class Two(torch.nn.Module):
        def __init__(self, names):
            super().__init__()
            for name in names:
                self.add_module(name, torch.nn.Linear(8, 8))
            self.names = names

        def forward(self, x):
            for name in self.names:
                x = getattr(self, name)(x)
            return x.sum()

    x = {"x": torch.randn(4, 8)}
    a, b = trace(Two(["a", "b"]), x), trace(Two(["first", "second", "third"]), x)
    assert set(_signatures(a)) == set(_signatures(b))
    assert mix_key(a) == mix_key(b)  # more of the same ops, under other names
    assert mix_key(gpt_graph(2)) == mix_key(gpt_graph(4)) != mix_key(gpt_graph(2, n_embd=64))


def test_the_cache_lives_under_nnscaler_cache_dir_per_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("NNSCALER_CACHE_DIR", str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"
    _, db = profile_graph(gpt_graph(1), repeats=1)
    assert db.path == tmp_path / "mine" / "autodist" / f"profile-{device_key('cpu')}.json" and db.path.is_file()
    assert device_key("cpu").startswith("cpu-") and f"{torch.get_num_threads()}threads" in device_key("cpu")
    monkeypatch.delenv("NNSCALER_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "nnscaler"
