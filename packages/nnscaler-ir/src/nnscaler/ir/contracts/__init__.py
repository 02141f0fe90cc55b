"""The typed contracts between nnscaler's packages: what the generated code promises the
runtime, and what the runtime tells the checkpoint package (plain dataclasses, JSON round trips,
no runtime import needed).

- `files`: the file names of a generated directory (``gencode{rank}.py``, the weights, the manifest);
- `GENERATED_ATTRS`: the class attributes of a generated module, with `GeneratedAttrs` declaring them;
- `PipelineMeta`: a pipelined module's stages and crossing values (its ``PIPELINE``);
- `Piece`: one piece of an op as a policy plans it (``Node.pieces``), read by codegen;
- `FullMapEntry`: where a rank's local tensor sits in its full tensor;
- `ZeroShardLayout` (`ZeroBucket`, `ZeroPiece`): how ZeRO shards the optimizer state;
- `HeldTensor` (`HeldRange`, `flat_blocks`): the parts of a local tensor a rank holds (``use_zero=3``);
- `OptimizerAttrs`: what an optimizer ``build_optimizer`` returned declares (``zero_layout``);
- `unit_names`: how ``use_zero=3`` groups parameters into gathered units;
- `MixedPrecision` (`UnitPrecision`, `mixed_precision`): the dtypes ``use_zero=3`` gathers and reduces in;
- `PlanReport` (`ModuleReport`, `OpSplit`, `Collective`, `UnannotatedOp`): what a plan split and the
  collectives it runs, written by codegen beside the code and read by the runtime.
"""
from . import files
from .files import CONSTANTS_FILE, GRAPH_FILE, MANIFEST, WEIGHTS_FILE, gencode_file, is_gencode_file
from .full_map import FullMapEntry
from .held_tensors import HeldRange, HeldTensor, flat_blocks
from .generated_module import GENERATED_ATTR_NAMES, GENERATED_ATTRS, GeneratedAttr, GeneratedAttrs
from .piece import Piece
from .shard_precision import MixedPrecision, UnitPrecision, mixed_precision
from .shard_units import (ROOT_UNIT, kept_after_forward, reshard_sizes, resolve_unit_modules, root_modules,
                          smaller_sizes, unit_names)
from .pipeline_meta import PipelineMeta
from .plan_report import (REPLICATED_WARN_FRACTION, REPORT_JSON, REPORT_TEXT, Collective, ModuleReport, OpSplit,
                          PlanReport, UnannotatedOp)
from .zero_layout import LAYOUT_VERSION, ZeroBucket, ZeroGeometry, ZeroPiece, ZeroShardLayout
from .optimizer_attrs import OptimizerAttrs

__all__ = ["files", "CONSTANTS_FILE", "GRAPH_FILE", "MANIFEST", "WEIGHTS_FILE", "gencode_file", "is_gencode_file",
           "FullMapEntry", "GENERATED_ATTR_NAMES", "GENERATED_ATTRS", "GeneratedAttr", "GeneratedAttrs", "Piece",
           "PipelineMeta", "REPLICATED_WARN_FRACTION", "REPORT_JSON", "REPORT_TEXT", "Collective", "ModuleReport", "OpSplit",
           "PlanReport", "UnannotatedOp", "ROOT_UNIT", "unit_names", "root_modules", "kept_after_forward", "reshard_sizes", "smaller_sizes",
           "resolve_unit_modules", "LAYOUT_VERSION", "ZeroBucket", "ZeroGeometry", "ZeroPiece", "ZeroShardLayout",
           "OptimizerAttrs", "HeldRange", "HeldTensor", "flat_blocks", "MixedPrecision", "UnitPrecision", "mixed_precision"]
