"""nnscaler.trainer.hf: Hugging Face models and text in the Trainer (docs/trainer.md, "Hugging Face
models"); needs the ``hf`` extra (``pip install nnscaler-trainer[hf]``: transformers, datasets).

- `CausalLM`: any ``AutoModelForCausalLM`` as ``model.type``; its checkpoints merge into a
  ``from_pretrained`` directory (``nnscaler ckpt merge SRC DST --hf``);
- `TokenizedText`: local .txt / .jsonl / .parquet files, tokenized and packed into fixed-length
  blocks, as ``dataset.type``.
"""
from .causal_lm import CausalLM
from .tokenized_text import TokenizedText

__all__ = ["CausalLM", "TokenizedText"]
