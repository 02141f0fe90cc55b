"""nnscaler.ckpt: checkpoints of parallelized training (docs/checkpoints.md).

- `save(path, module, optimizer=None, *, kind="sharded"|"deduped", extra=None)`: collective;
- `async_save(...)` (same arguments) -> `AsyncSave`: collective; returns once this rank's state is
  copied, the checkpoint is written and committed in a background process (``handle.wait()``);
  `stop_async_saves()` waits for it and ends that process; `prepare_async_save(module, optimizer)`
  makes that process and its buffer ahead (at set-up), so the first `async_save` blocks no longer
  than the later ones;
- `load(path, module, optimizer=None) -> extra`: collective, into any plan and world size, from
  a checkpoint or a Hugging Face model directory (``model.safetensors`` / its index: `hf_load`);
- `merge(src, dst, *, max_shard_size="5GB", model_only=False, hf=False)`: offline, streaming, the
  Hugging Face layout; with ``hf=True`` a ``from_pretrained`` directory, from the `HFRecord` the
  run stored in its ``extra`` under `HF_EXTRA_KEY`;
- `verify(path)`, `inspect(path)`: offline checks and summaries;
- `convert(src, dst)`: a torch ``state_dict`` file or a Hugging Face directory -> merged;
- `encode_extra(value)` / `decode_extra(data)`: tuples, dtypes, non-string keys and non-finite
  floats through an ``extra`` and back;
- `rng_snapshot(module)` / `restore_rng_snapshot(snapshot, module)`: the RNG states a checkpoint
  holds, kept in memory to set again later (the Trainer, right before training starts).

A checkpoint is a directory committed atomically, with a ``manifest.json`` written last; tensors
live in safetensors files, everything else in JSON. Nothing is ever unpickled on load.
"""
from .errors import CheckpointError
from .names import FORMAT_VERSION, KINDS
from .save import save
from .async_save import AsyncSave, AsyncSaveWarning, async_save, prepare_async_save, stop_async_saves
from .load_any import load
from .hf_load import is_hf_directory
from .verify import verify
from .summary import inspect
from .merge import merge
from .hf_export import EXTRA_KEY as HF_EXTRA_KEY, HFRecord
from .convert import convert
from .extra import decode_extra, encode_extra
from .rng import restore_rng_snapshot, rng_snapshot

__all__ = ["save", "async_save", "prepare_async_save", "AsyncSave", "AsyncSaveWarning", "stop_async_saves", "load", "is_hf_directory", "merge", "verify",
           "inspect", "convert", "CheckpointError", "FORMAT_VERSION", "KINDS", "encode_extra", "decode_extra",
           "rng_snapshot", "restore_rng_snapshot", "HFRecord", "HF_EXTRA_KEY"]
