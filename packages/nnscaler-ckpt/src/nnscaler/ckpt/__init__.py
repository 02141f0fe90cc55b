"""nnscaler.ckpt: checkpoint formats (sharded, deduped, merged), merge, reshard.

Skeleton: this package has no code yet and exports nothing. It will hold the on-disk formats
(atomic directories with a ``manifest.json``, tensors in safetensors files), saving and loading
of model, optimizer, scheduler, RNG and data-position state, streaming merge, resharding on
load, verification, and the ``nnscaler ckpt`` command. See the package README.
"""
