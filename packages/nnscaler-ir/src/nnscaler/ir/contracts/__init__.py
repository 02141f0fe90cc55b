"""The typed contracts between nnscaler's packages: what the generated code promises the
runtime, and what the runtime tells the checkpoint package (plain dataclasses, JSON round trips,
no runtime import needed)."""
from .full_map import FullMapEntry
from .zero_layout import LAYOUT_VERSION, ZeroBucket, ZeroPiece, ZeroShardLayout

__all__ = ["FullMapEntry", "LAYOUT_VERSION", "ZeroBucket", "ZeroPiece", "ZeroShardLayout"]
