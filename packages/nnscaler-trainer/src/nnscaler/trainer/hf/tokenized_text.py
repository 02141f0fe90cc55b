"""`TokenizedText`: local text files, tokenized and packed into fixed-length blocks.

Files are read through the ``datasets`` library (``text``, ``json`` or ``parquet`` builder by the
files' extension), tokenized by a local tokenizer directory (``AutoTokenizer``), joined with the
tokenizer's EOS token between documents, and cut into non-overlapping blocks of `block_size`
tokens (the remainder is dropped). Every rank computes the same blocks, so the Trainer's sampler
decides the order alone: the data order is deterministic. The token stream is held in memory, one
int64 array (8 bytes a token); documents are read and tokenized a batch at a time, and the blocks
are views of that array, so a long `block_size` (4096, 16384, ...) costs no more than a short one.
Under ``pas_policy: cp`` `block_size` must split into 2 x cp equal chunks
(`TokenizedText.validate_trainer_args`, before any worker starts).

``pack: true`` keeps the documents apart inside a block: each sample also carries ``position_ids``
restarting at 0 where a document starts (and at the block's start), which transformers reads as
packed sequences (attention within each document; under ``cp`` ring attention reads the mask as
key intervals, balanced, never a (block, block) matrix), and ``labels`` with -100 at each
document's first token, so that no document's last token is trained to predict the next one. The
documents' starts are kept as one int64 offset per document.
"""
from __future__ import annotations

import glob
import inspect
import itertools
import os
from typing import Dict, Iterator, List, Optional, Sequence, Union

import numpy as np
import torch

from ..errors import TrainerConfigError
from .causal_lm import import_transformers

__all__ = ["TokenizedText"]

_BUILDERS = {".txt": "text", ".md": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
_DOCS_PER_BATCH = 1000  # documents tokenized per call: the Python lists of one batch at a time


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
    (None: its default, ``~/.cache/huggingface/datasets`` or ``HF_HOME``); `pack`: samples also
    carry ``position_ids`` restarting per document and ``labels`` (-100 at each document's first
    token): attention and the loss stay within each document (module docstring)."""

    def __init__(self, files: Union[str, Sequence[str]], tokenizer: str, block_size: int = 128,
                 split: str = "train", val_fraction: float = 0.0, text_field: str = "text",
                 cache_dir: Optional[str] = None, pack: bool = False):
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
        if not isinstance(pack, bool):
            raise TrainerConfigError(f"{key}.pack", f"{pack!r}: use true (documents kept apart) or false")
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.pack = pack
        ids, starts = _tokenize(_read_texts(paths, text_field, cache_dir, key), tokenizer, f"{key}.tokenizer")
        blocks = ids[:len(ids) // block_size * block_size].view(-1, block_size)
        cut = len(blocks) - int(len(blocks) * val_fraction)
        self.blocks = {"train": blocks[:cut], "val": blocks[cut:], "all": blocks}[split]
        self._first = cut if split == "val" else 0  # the stream's block index of self.blocks[0]
        self._starts = starts if pack else None
        if len(self.blocks) == 0:
            raise _too_small(key, len(ids), len(blocks), block_size, val_fraction, paths)

    @classmethod
    def validate_trainer_args(cls, args) -> None:
        """Before any worker starts (`TrainerArgs.validate`): under ``pas_policy: cp`` the
        `block_size` of the train and val sets is a multiple of 2 x cp (cp = plan_ngpus /
        pp_size): ring attention cuts every sequence into 2 x cp equal chunks (causal rows
        balanced: chunks i and 2cp-1-i on rank i). Raises TrainerConfigError naming the values."""
        from ..config.values import build_args
        from .causal_lm import cp_size
        cp = cp_size(args)
        if cp < 2 or args.uses_parallel_modules:
            return
        default = inspect.signature(cls.__init__).parameters["block_size"].default
        for stage in ("train", "val"):
            raw = getattr(args.dataset, f"{stage}_args")
            if stage == "val" and not raw:
                continue
            block = build_args(raw, f"dataset.{stage}_args").get("block_size", default)
            if isinstance(block, int) and not isinstance(block, bool) and block >= 1 and block % (2 * cp):
                raise TrainerConfigError(f"dataset.{stage}_args.block_size", _not_ring_chunks(block, cp, args))

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        if not self.pack:
            return {"input_ids": self.blocks[i]}
        ids = self.blocks[i]
        first = (self._first + (i % len(self.blocks))) * self.block_size
        t = np.arange(first, first + self.block_size)
        begin = np.maximum(self._starts[np.searchsorted(self._starts, t, side="right") - 1], first)
        positions = torch.from_numpy(t - begin)
        return {"input_ids": ids, "position_ids": positions, "labels": ids.masked_fill(positions == 0, -100)}


def _not_ring_chunks(block: int, cp: int, args) -> str:
    chunks = 2 * cp
    cc = args.compute_config
    pp = cc.plan_ngpus // cp
    size = f"plan_ngpus {cc.plan_ngpus}" + (f" / pp_size {pp}" if pp > 1 else "")
    low, high = block // chunks * chunks, (block // chunks + 1) * chunks
    use = f"{low} or {high}" if low else f"{high}"
    return (f"is {block}, but pas_policy 'cp' cuts every sequence into 2 x cp = {chunks} equal chunks (cp {cp} = "
            f"{size}; ring attention balances the causal rows, chunks i and {chunks - 1}-i on rank i), and {block} "
            f"is not a multiple of {chunks}: use block_size {use} (a multiple of {chunks})")


def _too_small(key: str, tokens: int, blocks: int, block_size: int, val_fraction: float,
               paths: List[str]) -> TrainerConfigError:
    files = paths[0] if len(paths) == 1 else f"{len(paths)} files ({paths[0]}, ...)"
    if blocks == 0:
        return TrainerConfigError(f"{key}.block_size", f"is {block_size}, but {files} hold {tokens} tokens, not "
                                                       f"one block of {block_size}: give more text (files) or a "
                                                       f"block_size of at most {tokens}")
    return TrainerConfigError(f"{key}.val_fraction", f"is {val_fraction}, which keeps {int(blocks * val_fraction)} "
                                                     f"of the {blocks} blocks of {block_size} tokens ({files}) for "
                                                     f"val: raise val_fraction to at least {1 / blocks:.3g}, lower "
                                                     f"block_size or give more text")


def _read_texts(paths: List[str], field: str, cache_dir: Optional[str], key: str) -> Iterator[List[str]]:
    """The non-empty documents, a batch (a list) at a time."""
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
    return ([t for t in batch[field] if t] for batch in data.select_columns([field]).iter(batch_size=_DOCS_PER_BATCH))


def _tokenize(batches: Iterator[List[str]], path: str, key: str):
    """Every document's tokens followed by EOS, as one int64 tensor, and the documents' start offsets
    (int64 array); each batch of documents goes from the tokenizer's lists straight into an array
    (C loops, no per-token Python)."""
    transformers = import_transformers(key)
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise TrainerConfigError(key, f"{path!r} is not a tokenizer directory transformers can read ({e})") from None
    eos = tokenizer.eos_token_id
    pieces: List[np.ndarray] = []
    starts: List[np.ndarray] = []
    done = 0
    for texts in batches:
        if not texts:
            continue
        docs = tokenizer(texts, add_special_tokens=False)["input_ids"]
        lengths = np.fromiter(map(len, docs), dtype=np.int64, count=len(docs))
        flat = np.fromiter(itertools.chain.from_iterable(docs), dtype=np.int64, count=int(lengths.sum()))
        if eos is not None:  # after every document
            flat = np.insert(flat, np.cumsum(lengths), eos)
            lengths = lengths + 1
        starts.append(done + np.concatenate([[0], np.cumsum(lengths)[:-1]]))
        done += len(flat)
        pieces.append(flat)
        del docs
    ids = np.concatenate(pieces) if len(pieces) > 1 else (pieces[0] if pieces else np.zeros(0, dtype=np.int64))
    return torch.from_numpy(ids), (np.concatenate(starts).astype(np.int64) if starts else np.zeros(1, dtype=np.int64))
