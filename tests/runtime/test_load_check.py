"""Program identity of generated code on different nodes (runtime/driver/load_check.py), without processes."""
from __future__ import annotations

import copy

from nnscaler.runtime.driver.load_check import identity_differences, program_identity


def _manifest():
    files = {f"gencode{r}.py": {"sha256": f"g{r}", "size": 1} for r in range(2)}
    files.update({"constants.safetensors": {"sha256": "c", "size": 1},
                  "fullmodel.safetensors": {"sha256": "w", "size": 1},
                  "plan_report.txt": {"sha256": "p", "size": 1}})
    return {"module_class": "m.Net", "class_name": "GenNet", "graph_fingerprint": "f1", "policy": "tp",
            "compute_config": {"plan_ngpus": 2, "runtime_ngpus": 4}, "input_schema": {"x": 1}, "files": files}


def test_same_program_and_a_received_copy_agree():
    ours = program_identity(_manifest())
    received = _manifest()
    del received["files"]["fullmodel.safetensors"]  # broadcast_strategy='code' does not send it
    received["files"]["plan_report.txt"]["sha256"] = "other"  # informational, not the program
    assert identity_differences(ours, program_identity(received)) == []


def test_stale_code_names_the_differing_fields():
    ours = program_identity(_manifest())
    stale = copy.deepcopy(_manifest())
    stale["graph_fingerprint"] = "f0"
    stale["compute_config"]["plan_ngpus"] = 1
    stale["files"]["gencode1.py"]["sha256"] = "old"
    stale["files"]["fullmodel.safetensors"]["sha256"] = "old weights"
    del stale["files"]["constants.safetensors"]
    diffs = identity_differences(ours, program_identity(stale))
    assert "graph_fingerprint: rank 0 'f1', here 'f0'" in diffs
    assert "compute_config.plan_ngpus: rank 0 2, here 1" in diffs
    assert "gencode1.py: content differs (SHA-256)" in diffs
    assert "fullmodel.safetensors: content differs (SHA-256)" in diffs
    assert "constants.safetensors: missing here" in diffs


def test_code_whose_graph_is_not_its_manifests_is_refused(tmp_path):
    """GRAPH_FINGERPRINT (written into every generated class) must be the manifest's graph_fingerprint."""
    import json

    import pytest
    import toy_models
    from nnscaler import ComputeConfig, parallelize
    from nnscaler.ir import GenerationError
    from nnscaler.ir.contracts import MANIFEST
    from nnscaler.runtime.driver.load_check import load_on_every_rank

    parallelize(toy_models.MLP(), toy_models.mlp_batch(0, 4), "dp", ComputeConfig(1, 1, trace_strategy="cpu"),
                gen_savedir=tmp_path, load_module=False)
    [manifest] = tmp_path.rglob(MANIFEST)
    assert load_on_every_rank(manifest.parent, 0, "none").GRAPH_FINGERPRINT == json.loads(
        manifest.read_text())["graph_fingerprint"]
    data = json.loads(manifest.read_text())
    data["graph_fingerprint"] = "0" * 16
    manifest.write_text(json.dumps(data))
    with pytest.raises(GenerationError, match="was generated from graph"):
        load_on_every_rank(manifest.parent, 0, "none")
