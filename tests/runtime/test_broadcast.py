"""What rank 0 sends (runtime/driver/broadcast.py) and reuse of a received copy, without processes."""
from __future__ import annotations

import json

from nnscaler.runtime.driver.broadcast import _header, files_to_send
from nnscaler.runtime.driver.gen_dir import ReuseDecision, Identity, ReuseType, decide, write_manifest


def _generated(directory, received=None):
    directory.mkdir(parents=True)
    for name in ("gencode0.py", "gencode1.py", "constants.safetensors", "graph.json", "fullmodel.safetensors"):
        (directory / name).write_text(name)
    identity = Identity("m.Net", {"plan_ngpus": 1, "constant_folding": False, "user_config": {}}, "dp", {"x": 1})
    data = write_manifest(directory, identity, "f1", "GenNet")
    if received is not None:  # what a receiving node writes (broadcast._receive)
        for name in received["omitted"]:
            (directory / name).unlink()
            del data["files"][name]
        data["received"] = received
        (directory / "manifest.json").write_text(json.dumps(data))
    return identity


def test_files_per_strategy(tmp_path):
    _generated(tmp_path / "g")
    assert files_to_send(tmp_path / "g", "code") == ["constants.safetensors", "gencode0.py", "gencode1.py",
                                                      "manifest.json"]
    assert "fullmodel.safetensors" not in files_to_send(tmp_path / "g", "no_weights")
    assert files_to_send(tmp_path / "g", "none") == []


def test_a_received_copy_cannot_send_what_it_never_got(tmp_path):
    directory = tmp_path / "g"
    _generated(directory, {"strategy": "code", "omitted": ["fullmodel.safetensors", "graph.json"]})
    assert "error" not in _header(directory, "code")
    message = _header(directory, "all")["error"]
    assert "fullmodel.safetensors, graph.json" in message and "broadcast_strategy='code'" in message
    assert "node rank 0" in message
    assert _header(directory, "no_weights")["error"].startswith("broadcast_strategy='no_weights' must send graph.json")


def test_a_received_copy_is_reused_and_regenerated_for_graph(tmp_path):
    directory = tmp_path / "g"
    identity = _generated(directory, {"strategy": "code", "omitted": ["fullmodel.safetensors", "graph.json"]})
    assert decide(directory, ReuseType.MATCH, identity) is ReuseDecision.REUSE  # its manifest lists what it holds
    assert decide(directory, ReuseType.GRAPH, identity) is ReuseDecision.GENERATE  # no graph.json to reuse
