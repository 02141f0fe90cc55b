"""ckpt/hf_names.py: a Hugging Face directory's tensor names under the module's, as transformers 5
renames and fuses them (Mixtral's ``block_sparse_moe`` -> ``mlp``; experts stored one by one ->
``experts.gate_up_proj`` / ``experts.down_proj``, gate rows before up rows); a module that keeps
its experts one by one takes the names as they are; a missing expert and shapes that disagree are
refused by name. No processes, headers only."""
from __future__ import annotations

import pytest

from nnscaler.ckpt import CheckpointError
from nnscaler.ckpt.hf_names import converted_name, targets

E, I, H = 4, 6, 5


def _mixtral_files(experts=E, skip=()):
    files = {"model.layers.0.block_sparse_moe.gate.weight": ("a.safetensors", (experts, H), "float32")}
    for e in range(experts):
        for part, shape in (("w1", (I, H)), ("w2", (H, I)), ("w3", (I, H))):
            key = f"model.layers.0.block_sparse_moe.experts.{e}.{part}.weight"
            if key not in skip:
                files[key] = ("b.safetensors" if e % 2 else "a.safetensors", shape, "float32")
    return files


FUSED = {"model.layers.0.mlp.gate.weight": (E, H), "model.layers.0.mlp.experts.gate_up_proj": (E, 2 * I, H),
         "model.layers.0.mlp.experts.down_proj": (E, H, I)}


def test_names_transformers_converts():
    assert converted_name("model.layers.0.block_sparse_moe.experts.3.w1.weight") == \
        "model.layers.0.mlp.experts.gate_up_proj"
    assert converted_name("model.layers.0.block_sparse_moe.experts.3.w2.weight") == \
        "model.layers.0.mlp.experts.down_proj"
    assert converted_name("model.layers.0.block_sparse_moe.gate.weight") == "model.layers.0.mlp.gate.weight"
    assert converted_name("model.layers.2.mlp.experts.0.up_proj.weight") == "model.layers.2.mlp.experts.gate_up_proj"
    assert converted_name("model.layers.2.mlp.shared_experts.up_proj.weight") is None
    assert converted_name("model.norm.weight") is None


def test_mixtral_experts_are_pieces_of_the_fused_tensors():
    found = targets("d", _mixtral_files(), FUSED)
    assert set(found) == set(FUSED)
    assert found["model.layers.0.mlp.gate.weight"].file_names() == ["model.layers.0.block_sparse_moe.gate.weight"]
    gate_up = found["model.layers.0.mlp.experts.gate_up_proj"]
    assert gate_up.shape == (E, 2 * I, H)
    by_key = {s.key: s for s in gate_up.sources}
    assert len(by_key) == 2 * E and all(s.squeezed for s in by_key.values())
    assert by_key["model.layers.0.block_sparse_moe.experts.3.w1.weight"].region == ((3, 4), (0, I), (0, H))
    assert by_key["model.layers.0.block_sparse_moe.experts.3.w3.weight"].region == ((3, 4), (I, 2 * I), (0, H))
    assert by_key["model.layers.0.block_sparse_moe.experts.1.w3.weight"].file == "b.safetensors"
    down = found["model.layers.0.mlp.experts.down_proj"]
    assert down.shape == (E, H, I)
    assert {s.region for s in down.sources} == {((e, e + 1), (0, H), (0, I)) for e in range(E)}


def test_a_module_with_experts_one_by_one_takes_the_names_as_they_are():
    files = _mixtral_files()
    found = targets("d", files, {k: shape for k, (_, shape, _) in files.items()})
    assert set(found) == set(files) and not any(s.squeezed for t in found.values() for s in t.sources)


def test_a_missing_expert_is_named_with_the_fix():
    lacking = "model.layers.0.block_sparse_moe.experts.3.w3.weight"
    with pytest.raises(CheckpointError, match=r"d: model.layers.0.mlp.experts.gate_up_proj is stored per expert, and "
                                              rf"the directory lacks {lacking}: copy the model's files completely "
                                              r"\(every expert's w1 and w3\)"):
        targets("d", _mixtral_files(skip={lacking}), FUSED)
    # the last expert missing altogether: the module's shape says how many there are
    last = {f"model.layers.0.block_sparse_moe.experts.3.{p}.weight" for p in ("w1", "w2", "w3")}
    with pytest.raises(CheckpointError, match=r"lacks model.layers.0.block_sparse_moe.experts.3.w1.weight, "
                                              r"model.layers.0.block_sparse_moe.experts.3.w3.weight: "):
        targets("d", _mixtral_files(skip=last), FUSED)


def test_experts_of_different_shapes_are_refused():
    files = _mixtral_files()
    files["model.layers.0.block_sparse_moe.experts.2.w1.weight"] = ("a.safetensors", (I + 1, H), "float32")
    with pytest.raises(CheckpointError, match=r"per-expert tensors of model.layers.0.mlp.experts.gate_up_proj .* "
                                              r"differ in shape"):
        targets("d", files, FUSED)
