"""`nnscaler.trainer.hf.TokenizedText`: .txt / .jsonl / .parquet through `datasets`, tokenized by a
local tokenizer, packed into blocks; the same blocks from every format and on every build; with
``pack: true`` each sample's position_ids restart at every document (and block) start and its
labels ignore each document's first token; bad input is a TrainerConfigError naming the key and
the fix."""
from __future__ import annotations

import json
import os

import pytest
import torch

from nnscaler.trainer import TrainerConfigError
from nnscaler.trainer.hf import TokenizedText

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKENIZER = os.path.join(ROOT, "examples", "trainer", "hf_llama")
DOCS = ["The Trainer reads a YAML file.\nIt trains on many processes.", "Checkpoints merge into one directory.",
        "A third document, with more words in it than the others have."]


@pytest.fixture(scope="module")
def expected():
    tok = transformers.AutoTokenizer.from_pretrained(TOKENIZER)
    ids = []
    for doc in DOCS:
        ids += tok(doc, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    return torch.tensor(ids)


def write(folder, kind):
    os.makedirs(folder, exist_ok=True)
    if kind == "txt":
        for i, doc in enumerate(DOCS):
            with open(os.path.join(folder, f"doc{i}.txt"), "w") as f:
                f.write(doc)
        return os.path.join(folder, "*.txt")
    if kind == "jsonl":
        path = os.path.join(folder, "docs.jsonl")
        with open(path, "w") as f:
            f.writelines(json.dumps({"body": d, "id": i}) + "\n" for i, d in enumerate(DOCS))
        return path
    path = os.path.join(folder, "docs.parquet")
    datasets.Dataset.from_dict({"body": DOCS}).to_parquet(path)
    return path


@pytest.mark.parametrize("kind", ["txt", "jsonl", "parquet"])
def test_blocks_are_the_tokenized_documents(tmp_path, kind, expected):
    files = write(tmp_path / kind, kind)
    field = "text" if kind == "txt" else "body"
    ds = TokenizedText(files, TOKENIZER, block_size=8, split="all", text_field=field, cache_dir=str(tmp_path / "c"))
    n = len(expected) // 8
    assert len(ds) == n
    assert torch.equal(torch.stack([ds[i]["input_ids"] for i in range(n)]).flatten(), expected[:n * 8])
    assert ds[0]["input_ids"].dtype == torch.long and ds.tokenizer == TOKENIZER


def test_train_and_val_split_the_blocks(tmp_path, expected):
    files = write(tmp_path, "txt")
    args = dict(block_size=4, val_fraction=0.25, cache_dir=str(tmp_path / "c"))
    train, val = TokenizedText(files, TOKENIZER, split="train", **args), TokenizedText(files, TOKENIZER, split="val", **args)
    every = TokenizedText(files, TOKENIZER, split="all", **args)
    assert len(val) == len(every) // 4 and len(train) + len(val) == len(every)
    assert torch.equal(torch.cat([train.blocks, val.blocks]), every.blocks)
    again = TokenizedText(files, TOKENIZER, split="train", **args)
    assert torch.equal(again.blocks, train.blocks)


@pytest.mark.parametrize("case,key,match", [
    ("missing", "dataset.train_args.files", "matches no file"),
    ("mixed", "dataset.train_args.files", "files of one kind"),
    ("tokenizer", "dataset.train_args.tokenizer", "not a directory"),
    ("field", "dataset.train_args.text_field", "no column 'text'"),
    ("block", "dataset.train_args.block_size", "hold [0-9]+ tokens, not one block of 100000"),
    ("split", "dataset.train_args.split", "use train, val or all"),
])
def test_bad_input_names_the_key(tmp_path, case, key, match):
    txt = write(tmp_path / "t", "txt")
    jsonl = write(tmp_path / "j", "jsonl")
    args = dict(files=txt, tokenizer=TOKENIZER, block_size=4, cache_dir=str(tmp_path / "c"))
    args.update({"missing": dict(files=str(tmp_path / "nope.txt")), "mixed": dict(files=[txt, jsonl]),
                 "tokenizer": dict(tokenizer=str(tmp_path / "no-tokenizer")), "field": dict(files=jsonl),
                 "block": dict(block_size=100000), "split": dict(split="test")}[case])
    with pytest.raises(TrainerConfigError, match=match) as e:
        TokenizedText(**args)
    assert e.value.key == key


def test_documents_tokenized_a_batch_at_a_time_give_the_same_stream(tmp_path, expected, monkeypatch):
    from nnscaler.trainer.hf import tokenized_text
    monkeypatch.setattr(tokenized_text, "_DOCS_PER_BATCH", 2)  # 3 documents: batches of 2 and 1
    ds = TokenizedText(write(tmp_path, "jsonl"), TOKENIZER, block_size=1, split="all", text_field="body",
                       cache_dir=str(tmp_path / "c"))
    assert torch.equal(ds.blocks.flatten(), expected)


def test_long_blocks_are_views_of_one_token_array(tmp_path):
    """16384-token blocks: the same tokens as tokenizing each document, one int64 array (8 bytes a
    token) of which every block is a view; a text too short for one block names the count."""
    tok = transformers.AutoTokenizer.from_pretrained(TOKENIZER)
    docs = [f"Document {i}: " + " ".join(f"word{(i * 7 + j) % 97} and more text" for j in range(400))
            for i in range(60)]
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    stream = [t for d in tok(docs, add_special_tokens=False)["input_ids"] for t in d + [tok.eos_token_id]]
    block = 16384
    assert len(stream) > 3 * block
    every = TokenizedText(str(path), TOKENIZER, block_size=block, split="all", cache_dir=str(tmp_path / "c"))
    n = len(stream) // block
    assert every.blocks.shape == (n, block) and every[0]["input_ids"].dtype == torch.long
    assert torch.equal(every.blocks.flatten(), torch.tensor(stream[:n * block]))
    assert every.blocks.untyped_storage().nbytes() == 8 * len(stream)  # the stream once, no copy per block
    assert every[n - 1]["input_ids"].untyped_storage().data_ptr() == every.blocks.untyped_storage().data_ptr()
    val = TokenizedText(str(path), TOKENIZER, block_size=block, split="val", val_fraction=0.34,
                        cache_dir=str(tmp_path / "c"))
    assert len(val) == int(n * 0.34) and torch.equal(val.blocks, every.blocks[n - len(val):])
    with pytest.raises(TrainerConfigError) as e:
        TokenizedText(str(path), TOKENIZER, block_size=len(stream) + 1, cache_dir=str(tmp_path / "c"))
    assert e.value.key == "dataset.train_args.block_size"
    assert f"hold {len(stream)} tokens, not one block of {len(stream) + 1}" in str(e.value)
    assert f"a block_size of at most {len(stream)}" in str(e.value)
    with pytest.raises(TrainerConfigError) as e:  # blocks, but none for val
        TokenizedText(str(path), TOKENIZER, block_size=block, split="val", val_fraction=0.05,
                      cache_dir=str(tmp_path / "c"))
    assert e.value.key == "dataset.val_args.val_fraction"
    assert f"keeps 0 of the {n} blocks of {block} tokens" in str(e.value) and "at least" in str(e.value)


def test_pack_keeps_document_boundaries(tmp_path, expected):
    files = write(tmp_path / "txt", "txt")
    plain = TokenizedText(files, TOKENIZER, block_size=8, split="all", cache_dir=str(tmp_path / "c"))
    packed = TokenizedText(files, TOKENIZER, block_size=8, split="all", cache_dir=str(tmp_path / "c"), pack=True)
    val = TokenizedText(files, TOKENIZER, block_size=8, split="val", val_fraction=0.5, cache_dir=str(tmp_path / "c"),
                        pack=True)
    tok = transformers.AutoTokenizer.from_pretrained(TOKENIZER)
    lengths = [len(tok(d, add_special_tokens=False)["input_ids"]) + 1 for d in DOCS]  # with EOS
    n = len(packed)
    got = torch.stack([packed[i]["position_ids"] for i in range(n)]).flatten().tolist()
    starts = set(torch.cumsum(torch.tensor([0] + lengths[:-1]), 0).tolist())
    for t, p in enumerate(got):  # restarts exactly at document and block starts, else counts on
        assert (p == 0) == (t in starts or t % 8 == 0), (t, p)
        assert p == 0 or p == got[t - 1] + 1, (t, p)
    for i in range(n):
        s = packed[i]
        assert torch.equal(s["input_ids"], plain[i]["input_ids"])
        assert torch.equal(s["labels"], s["input_ids"].masked_fill(s["position_ids"] == 0, -100))
    assert torch.equal(val[0]["position_ids"], packed[len(packed) - len(val)]["position_ids"])
    with pytest.raises(TrainerConfigError, match=r"pack.*'yes': use true"):
        TokenizedText(files, TOKENIZER, block_size=8, split="all", cache_dir=str(tmp_path / "c"), pack="yes")
