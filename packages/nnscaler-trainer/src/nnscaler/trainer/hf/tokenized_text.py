"""`TokenizedText`: local text files, tokenized and packed into fixed-length blocks.

Files are read through the ``datasets`` library (``text``, ``json`` or ``parquet`` builder by the
files' extension), tokenized by a local tokenizer directory (``AutoTokenizer``), joined with the
tokenizer's EOS token between documents, and cut into non-overlapping blocks of `block_size`
tokens (the remainder is dropped). Every rank computes the same blocks, so the Trainer's sampler
decides the order alone: the data order is deterministic. The token stream is held in memory.
"""
from __future__ import annotations

import glob
import os
from typing import Dict, List, Optional, Sequence, Union

import torch

from ..errors import TrainerConfigError
from .causal_lm import import_transformers

__all__ = ["TokenizedText"]

_BUILDERS = {".txt": "text", ".md": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def _files(paths: Union[str, Sequence[str]], key: str) -> List[str]:
    out: List[str] = []
    for pattern in [paths] if isinstance(paths, str) else list(paths):
        found = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        if not found or not all(os.path.isfile(f) for f in found):
            raise TrainerConfigError(key, f"{pattern!r} matches no file (resolved from {os.getcwd()}): give local "
                                          f".txt/.md, .jsonl or .parquet files or a glob, relative to the working "
                                          f"directory (or absolute)")
        out += found
    kinds = {_BUILDERS.get(os.path.splitext(f)[1].lower()) for f in out}
    if None in kinds or len(kinds) != 1:
        raise TrainerConfigError(key, f"{out}: give files of one kind, by extension: .txt/.md (text), "
                                      f".jsonl/.json (a text field per line) or .parquet")
    return out


class TokenizedText(torch.utils.data.Dataset):
    """``dataset.type: nnscaler.trainer.hf.TokenizedText``; each sample is ``{"input_ids":
    LongTensor[block_size]}`` (CausalLM's labels default to the inputs).

    `files`: a path, a glob or a list of them (.txt/.md: one document per file; .jsonl/.json and
    .parquet: one document per row, its `text_field`); `tokenizer`: a local tokenizer directory;
    `block_size`: tokens per sample; `split` / `val_fraction`: the last `val_fraction` of the
    blocks is ``val``, the rest ``train`` (``all``: every block); `cache_dir`: the datasets cache
    (None: its default, ``~/.cache/huggingface/datasets`` or ``HF_HOME``)."""

    def __init__(self, files: Union[str, Sequence[str]], tokenizer: str, block_size: int = 128,
                 split: str = "train", val_fraction: float = 0.0, text_field: str = "text",
                 cache_dir: Optional[str] = None):
        key = "dataset.val_args" if split == "val" else "dataset.train_args"
        if split not in ("train", "val", "all"):
            raise TrainerConfigError(f"{key}.split", f"{split!r}: use train, val or all")
        if block_size < 1 or not 0 <= val_fraction < 1:
            raise TrainerConfigError(key, f"block_size {block_size} must be >= 1 and val_fraction {val_fraction} "
                                          f"in [0, 1)")
        paths = _files(files, f"{key}.files")
        if not os.path.isdir(tokenizer):
            raise TrainerConfigError(f"{key}.tokenizer", f"{tokenizer!r} is not a directory (resolved from "
                                     f"{os.getcwd()}): give a local tokenizer directory (nothing is downloaded)")
        self.tokenizer = tokenizer
        self.block_size = block_size
        texts = _read_texts(paths, text_field, cache_dir, key)
        ids = _tokenize(texts, tokenizer, f"{key}.tokenizer")
        blocks = ids[:len(ids) // block_size * block_size].view(-1, block_size)
        cut = len(blocks) - int(len(blocks) * val_fraction)
        self.blocks = {"train": blocks[:cut], "val": blocks[cut:], "all": blocks}[split]
        if len(self.blocks) == 0:
            raise TrainerConfigError(key, f"{len(ids)} tokens make no {split} block of {block_size}: give more text, "
                                          f"a smaller block_size or another val_fraction")

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        return {"input_ids": self.blocks[i]}


def _read_texts(paths: List[str], field: str, cache_dir: Optional[str], key: str) -> List[str]:
    try:
        import datasets
    except ImportError:
        raise TrainerConfigError(key, "TokenizedText needs datasets: pip install 'nnscaler-trainer[hf]'") from None
    builder = _BUILDERS[os.path.splitext(paths[0])[1].lower()]
    options = {"sample_by": "document"} if builder == "text" else {}
    quiet = datasets.utils.are_progress_bars_disabled()
    datasets.utils.disable_progress_bars()  # one bar per rank and file helps nobody
    try:
        data = datasets.load_dataset(builder, data_files=paths, split="train", cache_dir=cache_dir, **options)
    finally:
        if not quiet:
            datasets.utils.enable_progress_bars()
    if field not in data.column_names:
        raise TrainerConfigError(f"{key}.text_field", f"{paths} have no column {field!r} (columns: "
                                                      f"{data.column_names}): name the text column")
    return [t for t in data[field] if t]


def _tokenize(texts: List[str], path: str, key: str) -> torch.Tensor:
    transformers = import_transformers(key)
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise TrainerConfigError(key, f"{path!r} is not a tokenizer directory transformers can read ({e})") from None
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ids: List[int] = []
    for doc in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids += doc + eos
    return torch.tensor(ids, dtype=torch.long)
