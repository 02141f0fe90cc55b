"""nnscaler.ckpt: Checkpoint formats (sharded, deduped, merged), merge, reshard."""
