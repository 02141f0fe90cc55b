"""The one error class of nnscaler.lightning: a deliberate refusal that names the user's thing
(the LightningModule hook, the Trainer argument, the checkpoint path) and what to do instead."""
from __future__ import annotations

from nnscaler.ir import NnScalerError

__all__ = ["NnScalerLightningError"]


class NnScalerLightningError(NnScalerError):
    """A configuration the nnscaler Lightning strategy cannot run, with the fix in the message."""
