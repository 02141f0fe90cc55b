"""What an optimizer built by the runtime's ``build_optimizer`` declares to other packages.

The runtime mixes `NnScalerOptimizerMixin` into the user's optimizer class (the optimizer stays an
instance of its own class); that mixin derives from `OptimizerAttrs`, so a package that must not
import the runtime (the checkpoint package) recognises such an optimizer with
``isinstance(opt, OptimizerAttrs)`` and reads its typed attributes, as it recognises a
parallelized module by `GeneratedAttrs`. Any other optimizer (a plain ``torch.optim.Adam``) is
not an `OptimizerAttrs` and is read as unsharded.
"""
from __future__ import annotations

from typing import Optional

from .zero_layout import ZeroShardLayout

__all__ = ["OptimizerAttrs"]


class OptimizerAttrs:
    """Declares ``zero_layout``: this rank's `ZeroShardLayout` (which elements of which local
    tensor each optimizer-state index covers) when the optimizer's state is sharded by ZeRO
    (``use_zero`` 1 or 3), None otherwise (the default here; the runtime's mixin overrides it)."""

    @property
    def zero_layout(self) -> Optional[ZeroShardLayout]:
        return None
