"""File names and constants of the on-disk format (docs/checkpoints.md)."""
from __future__ import annotations

import re

__all__ = ["FORMAT", "FORMAT_VERSION", "KINDS", "MANIFEST", "MANIFEST_TMP", "rank_file", "MERGED_MODEL", "MERGED_INDEX",
           "merged_shard", "MERGED_OPTIMIZER", "MERGED_RNG", "STAGING_MARK", "staging_prefix", "is_staging"]

FORMAT = "nnscaler-checkpoint"
FORMAT_VERSION = 1
KINDS = ("sharded", "deduped", "merged")
MANIFEST = "manifest.json"
MANIFEST_TMP = MANIFEST + ".tmp"  # a manifest being replaced (nnscaler.ir.atomic_write's temporary name)
MERGED_MODEL = "model.safetensors"
MERGED_INDEX = "model.safetensors.index.json"
MERGED_OPTIMIZER = "optimizer.safetensors"
MERGED_RNG = "rng.safetensors"
STAGING_MARK = ".writing-"  # a checkpoint being written: ``.<name>.writing-<token>`` beside it


def rank_file(rank: int, world_size: int) -> str:
    """``rank-0000r-of-0000n.safetensors``."""
    return f"rank-{rank:05d}-of-{world_size:05d}.safetensors"


def merged_shard(index: int, count: int) -> str:
    """``model-0000k-of-0000n.safetensors`` (1-based, as Hugging Face names them)."""
    return f"model-{index:05d}-of-{count:05d}.safetensors"


def staging_prefix(name: str) -> str:
    """The name prefix of the temporary siblings a checkpoint called `name` is written into."""
    return f".{name}{STAGING_MARK}"


_STAGING = re.compile(r"^\..+" + re.escape(STAGING_MARK) + r"[0-9a-f]+$")


def is_staging(name: str) -> bool:
    """Whether a directory name is a checkpoint still being written (or abandoned by a crash)."""
    return bool(_STAGING.match(name))
