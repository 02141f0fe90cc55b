"""Build the example's tokenizer locally: a byte-level BPE of 512 tokens trained on this
repository's docs (docs/*.md), saved to examples/trainer/hf_llama/ (tokenizer.json and
tokenizer_config.json, what ``AutoTokenizer.from_pretrained`` reads). Takes about a second:

    python examples/trainer/hf_tokenizer.py [OUT_DIR]

The result is committed beside hf_llama/config.json; run this again after changing the docs or
the vocabulary size (the model's ``vocab_size`` must stay >= the tokenizer's).
"""
from __future__ import annotations

import glob
import os
import sys

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
VOCAB = 512
SPECIAL = ["<|endoftext|>"]


def build(out_dir: str = os.path.join(HERE, "hf_llama")) -> str:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train(sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=SPECIAL[0], bos_token=SPECIAL[0],
                                   unk_token=SPECIAL[0], pad_token=SPECIAL[0])
    fast.save_pretrained(out_dir)
    return out_dir


if __name__ == "__main__":
    print(build(*sys.argv[1:]))
