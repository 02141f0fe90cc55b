"""The codegen <-> runtime contracts in nnscaler.ir.contracts: round trips and declarations."""
from __future__ import annotations

import json

import pytest

from nnscaler.ir.contracts import (CONSTANTS_FILE, GENERATED_ATTR_NAMES, GENERATED_ATTRS, MANIFEST, WEIGHTS_FILE,
                                   GeneratedAttrs, Piece, PipelineMeta, gencode_file, is_gencode_file)
from nnscaler.ir.errors import GenerationError
from nnscaler.ir.layout import Partial, Replicate, Shard

META = PipelineMeta(4, 8, "1f1b_interleaved", 2, 1, inputs={0: (), 1: (10,), 2: (11,), 3: (12, 99)},
                    outputs={0: (10, 99), 1: (11,), 2: (12,), 3: (13,)},
                    producer={10: 0, 11: 1, 12: 2, 13: 3, 99: 0},
                    consumers={10: (1,), 11: (2,), 12: (3,), 13: (), 99: (3,)},
                    kinds={10: "tensor", 11: "tensor", 12: "tensor", 13: "tensor", 99: "int"}, loss=13,
                    shared_groups=((0, 1),), shared={"wte.weight": ((0, 1),)})


def test_pipeline_meta_round_trips_as_literal_and_json():
    literal = META.to_dict()
    assert PipelineMeta.from_dict(literal) == META
    assert PipelineMeta.from_dict(eval(repr(literal))) == META  # what generated code carries
    assert PipelineMeta.from_dict(json.loads(json.dumps(literal))) == META  # JSON: keys become strings
    assert list(literal)[:5] == ["nstages", "nmicros", "scheduler", "pp_size", "tp_size"]


def test_pipeline_meta_reads_typed():
    assert META.is_int(99) and not META.is_int(10)
    assert META.plan.plan_ngpus == 2
    assert META.schedule().ndevices == 2
    assert META.inputs[3] == (12, 99) and META.loss == 13


def test_malformed_pipeline_meta_is_a_generation_error():
    with pytest.raises(GenerationError, match="malformed pipeline metadata"):
        PipelineMeta.from_dict({"nstages": 2})


def test_piece_round_trip_and_description():
    piece = Piece(1, 2, [Shard(0), Replicate()], [Partial()], dim="m", device=1)
    assert Piece.from_dict(json.loads(json.dumps(piece.to_dict()))) == piece
    assert not piece.is_replicated() and Piece(0, 2, [Replicate()], [Replicate()]).is_replicated()
    assert piece.describe() == "split m 1/2 on device 1: in [D(0), R] out [V]"


def test_piece_is_the_one_policies_create():
    from nnscaler.policies import Piece as PolicyPiece
    assert PolicyPiece is Piece


def test_generated_file_names():
    assert gencode_file(3) == "gencode3.py" and is_gencode_file(gencode_file(3))
    assert not any(is_gencode_file(n) for n in (MANIFEST, WEIGHTS_FILE, CONSTANTS_FILE))
    assert WEIGHTS_FILE == "fullmodel.safetensors"


def test_generated_attrs_are_declared_with_defaults_and_meaning():
    names = [a.name for a in GENERATED_ATTRS]
    assert names[0] == "COMPUTE_CONFIG" and names[-1] == "SOURCE_MAP" and len(set(names)) == len(names)
    assert set(names) == GENERATED_ATTR_NAMES and "FULL_NAMES" not in GENERATED_ATTR_NAMES
    for attr in GENERATED_ATTRS:
        assert attr.meaning and getattr(GeneratedAttrs, attr.name) == attr.default


def test_a_generated_class_gets_its_pipeline_typed():
    class Gen(GeneratedAttrs):
        PIPELINE = META.to_dict()
        RANK = 1

    class Plain(GeneratedAttrs):
        pass

    assert Gen.PIPELINE == META and Gen.RANK == 1
    assert Plain.PIPELINE is None and Plain.TRACED_TRAINING is True


def test_runtime_module_declares_from_the_contract():
    from nnscaler.runtime import ParallelModule
    assert issubclass(ParallelModule, GeneratedAttrs)
    assert all(hasattr(ParallelModule, name) for name in GENERATED_ATTR_NAMES)


def test_runtime_optimizer_declares_from_the_contract():
    """build_optimizer's mixin is the IR's OptimizerAttrs (what the checkpoint package reads);
    the contract's own zero_layout is None."""
    from nnscaler.ir.contracts import OptimizerAttrs
    from nnscaler.runtime.optimizer import NnScalerOptimizerMixin
    assert issubclass(NnScalerOptimizerMixin, OptimizerAttrs) and OptimizerAttrs().zero_layout is None



def test_zero_layout_is_a_zero_geometry_and_round_trips():
    import dataclasses
    from nnscaler.ir.contracts import ZeroGeometry, ZeroShardLayout
    assert len(dataclasses.fields(ZeroGeometry)) == 9 and issubclass(ZeroShardLayout, ZeroGeometry)
    layout = ZeroShardLayout(1, 4, 2, 2, 1, (1, 3), 0, 0, (1,), version=1, reduce_scatter=True, buckets=(), pieces=())
    assert ZeroShardLayout.from_dict(json.loads(json.dumps(layout.to_dict()))) == layout
    assert layout.group_size == 2


def test_unit_names_follow_repeated_blocks():
    from nnscaler.ir.contracts import unit_names
    names = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.experts.3.w1",
             "model.layers.1.self_attn.q_proj.weight", "model.layers.1.mlp.experts.0.w1", "model.norm.weight",
             "lm_head.weight", "single.0.weight"]
    units = unit_names(names)
    assert units["model.layers.0.self_attn.q_proj.weight"] == units["model.layers.0.mlp.experts.3.w1"] == \
        "model.layers.0"
    assert units["model.layers.1.mlp.experts.0.w1"] == "model.layers.1"
    # not a repeated block: a list holding one module, and everything outside the lists
    assert {units[n] for n in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
                               "single.0.weight")} == {""}
    # named units add to the block rule (as fully_shard on a sub-module): a path inside a block splits
    # it, a path around the blocks keeps them, a path outside them takes its parameters from the root
    named = unit_names(names, ["model.layers.0.mlp", "model.layers.1", "model", "single"])
    assert named["model.layers.0.mlp.experts.3.w1"] == "model.layers.0.mlp"
    assert named["model.layers.0.self_attn.q_proj.weight"] == "model.layers.0"
    assert named["model.layers.1.mlp.experts.0.w1"] == "model.layers.1"
    assert named["model.embed_tokens.weight"] == named["model.norm.weight"] == "model"
    assert named["single.0.weight"] == "single" and named["lm_head.weight"] == ""


def test_root_modules_are_the_embeddings_and_the_head():
    """Outside the blocks, each module holding a matrix is a unit of its own (a small root), but for
    a tied tensor's module and a module with other root parameters deeper under it."""
    from nnscaler.ir.contracts import root_modules, unit_names
    names = ["model.embed_tokens.weight", "model.layers.0.q.weight", "model.layers.1.q.weight", "model.norm.weight",
             "lm_head.weight", "lm_head.bias", "pos", "outer.scale", "outer.inner.weight"]
    shapes = {n: (8, 4) for n in names}
    shapes.update({"model.norm.weight": (4,), "lm_head.bias": (8,), "pos": (8, 4), "outer.scale": (2, 2)})
    assert root_modules(names, shapes) == ["lm_head", "model.embed_tokens", "outer.inner"]
    units = unit_names(names, root_modules(names, shapes))
    assert units["lm_head.bias"] == "lm_head" and units["model.norm.weight"] == units["pos"] == ""
    assert units["outer.scale"] == "" and units["model.layers.1.q.weight"] == "model.layers.1"
    assert root_modules(names, shapes, tied={"model.embed_tokens.weight", "lm_head.weight"}) == ["outer.inner"]
    assert root_modules(names, shapes, ["model"]) == ["lm_head", "outer.inner"]


def test_kept_after_forward_follows_reshard_after_forward():
    from nnscaler.ir import ConfigError
    from nnscaler.ir.contracts import kept_after_forward
    units = {"", "model.layers.0", "model.layers.1", "lm_head"}
    assert kept_after_forward(units, True) == []
    assert kept_after_forward(units, False) == sorted(units)
    assert kept_after_forward(units, {"lm_head": True, "model.layers.*": False, "": False}) == [
        "", "model.layers.0", "model.layers.1"]
    assert kept_after_forward(units, 1) == sorted(units)  # the int 1: a group of one rank, kept gathered
    assert kept_after_forward(units, True, 1) == [] and kept_after_forward(units, False, 1) == sorted(units)
    assert kept_after_forward(units, {"model.layers.*": 1, "": 2}, 4) == ["model.layers.0", "model.layers.1"]
    for bad in ("no", 0, {"model.layers.*": "2"}, {"model.layers.*": None}):
        with pytest.raises(ConfigError, match=r"zero3_reshard_after_forward'\](\[.*\])? is .*give"):
            kept_after_forward(units, bad)


def test_reshard_sizes_take_an_int_dividing_the_zero_group():
    """FSDP2's reshard_after_forward as an int k: the size of the smaller group a unit is resharded
    to after forward; True is the whole zero group (never the int 1), False and 1 keep it gathered."""
    from nnscaler.ir import ConfigError
    from nnscaler.ir.contracts import reshard_sizes, smaller_sizes
    units = {"", "model.layers.0", "model.layers.1", "lm_head"}
    assert reshard_sizes(units, True, 4) == dict.fromkeys(units, 4)
    assert reshard_sizes(units, False, 4) == reshard_sizes(units, 1, 4) == dict.fromkeys(units, 1)
    assert reshard_sizes(units, 2, 4) == dict.fromkeys(units, 2)
    assert reshard_sizes(units, {"model.layers.*": 2, "lm_head": False}, 4) == {
        "": 4, "model.layers.0": 2, "model.layers.1": 2, "lm_head": 1}
    assert reshard_sizes(units, {"model.layers.*": True, "*": 2}, 8) == {
        "": 2, "model.layers.0": 8, "model.layers.1": 8, "lm_head": 2}  # the first matching entry decides
    assert smaller_sizes({"a": 2, "b": 4, "c": True, "d": 1, "e": 8}, 8) == [2, 4]
    assert smaller_sizes(True, 8) == smaller_sizes(8, 8) == smaller_sizes(1, 8) == []
    for bad, text in ((3, "is 3, which does not divide the zero group size 4.*: 1, 2, 4"), (0, "at least 1"),
                      (8, "does not divide"), ("2", "the string '2'.*not a string"), (2.5, "is 2.5: give"),
                      ({"model.layers.*": 3}, r"\['model.layers.\*'\] is 3, which does not divide"),
                      ({1: 2}, "keys are unit names or globs")):
        with pytest.raises(ConfigError, match=r"pas_config\['zero3_reshard_after_forward'\].*" + text):
            reshard_sizes(units, bad, 4)
    assert reshard_sizes(units, 3, None) == dict.fromkeys(units, 3)  # the group size not known yet: k >= 1 only


def test_resolve_unit_modules_takes_classes_globs_and_paths():
    from nnscaler.ir import ConfigError
    from nnscaler.ir.contracts import resolve_unit_modules
    types = {"": "gpt.GPT", "h": "torch.nn.modules.container.ModuleList", "h.0": "gpt.Block", "h.1": "gpt.Block",
             "h.0.mlp": "gpt.MLP", "h.1.mlp": "gpt.MLP", "wte": "torch.nn.modules.sparse.Embedding"}
    assert resolve_unit_modules(types, ["Block"]) == resolve_unit_modules(types, "gpt.Block") == ["h.0", "h.1"]
    assert resolve_unit_modules(types, "h.*.mlp, wte") == ["h.0.mlp", "h.1.mlp", "wte"]
    assert resolve_unit_modules(types, ["h.1"]) == ["h.1"]
    with pytest.raises(ConfigError, match=r"'Blok' matches no module .* types there: Block, Embedding, MLP, ModuleList"):
        resolve_unit_modules(types, ["Blok"])
