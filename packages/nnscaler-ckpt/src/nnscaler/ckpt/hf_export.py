"""``merge(..., hf=True)`` / ``nnscaler ckpt merge SRC DST --hf``: a directory that
``transformers.AutoModelForCausalLM.from_pretrained(DST)`` loads.

The run records what transformers needs as an `HFRecord` in its checkpoint's ``extra`` under
`EXTRA_KEY` (``nnscaler.trainer.hf.CausalLM`` does it in its ``on_save_checkpoint`` hook): the
``config.json`` text, the wrapper's attribute prefix (``model.``), the names transformers ties on
load (``lm_head.weight``), ``generation_config.json`` and the tokenizer's files when known. The
merge then writes the model's tensors under the model's own names (the prefix stripped; a tied
weight once, under the name transformers stores, e.g. ``model.embed_tokens.weight``), the JSON
files and the tokenizer, and no optimizer or RNG states. This package never imports transformers.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch

from .checksums import bytes_record
from .errors import CheckpointError
from .extra import join_extra
from .names import MANIFEST, MERGED_INDEX, MERGED_OPTIMIZER, MERGED_RNG
from .records import FileRecord, Manifest

__all__ = ["EXTRA_KEY", "HFRecord", "read_hf_record", "hf_plan", "write_hf_files"]

EXTRA_KEY = "hugging_face"
CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
_RESERVED = {MANIFEST, MERGED_INDEX, MERGED_OPTIMIZER, MERGED_RNG, CONFIG, GENERATION_CONFIG}


@dataclasses.dataclass(frozen=True)
class HFRecord:
    """What a run records so that its checkpoints merge into a Hugging Face model directory.

    `config`: the ``config.json`` text; `prefix`: the attribute path of the transformers model
    inside the trained module (``"model."``), stripped from every name; `tied`: the model's names
    transformers ties to another weight on load and does not store (``lm_head.weight``);
    `generation_config`: ``generation_config.json`` text, or None; `tokenizer`: file name ->
    bytes of the tokenizer directory to copy along (empty: none)."""
    config: str
    prefix: str = ""
    tied: Tuple[str, ...] = ()
    generation_config: Optional[str] = None
    tokenizer: Mapping[str, bytes] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        try:
            config = json.loads(self.config)
        except ValueError as e:
            raise CheckpointError(f"HFRecord.config is not JSON ({e}): give the text of a config.json") from None
        if not isinstance(config, dict) or "model_type" not in config:
            raise CheckpointError("HFRecord.config has no 'model_type': give the text of a transformers config.json "
                                  "(PretrainedConfig.to_json_string())")
        for name in self.tokenizer:
            if not isinstance(name, str) or "/" in name or name.startswith(".") or name in _RESERVED \
                    or name.startswith("model") and name.endswith(".safetensors"):
                raise CheckpointError(f"HFRecord.tokenizer: {name!r} is not a tokenizer file name this directory can "
                                      f"hold; give plain names such as tokenizer.json")

    def to_extra(self, with_tokenizer: bool = True) -> Dict[str, Any]:
        """The value to store under ``extra[EXTRA_KEY]`` (tokenizer files as uint8 tensors; give
        ``with_tokenizer=False`` on every rank but one, so that they are stored once)."""
        files = self.tokenizer if with_tokenizer else {}
        return {"config": self.config, "prefix": self.prefix, "tied": list(self.tied),
                "generation_config": self.generation_config,
                "tokenizer": {n: torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else
                              torch.zeros(0, dtype=torch.uint8) for n, data in files.items()}}

    @classmethod
    def from_extra(cls, data: Any) -> "HFRecord":
        if not isinstance(data, dict) or not isinstance(data.get("config"), str):
            raise CheckpointError(f"extra[{EXTRA_KEY!r}] is not an HFRecord: save HFRecord(...).to_extra() there")
        files = {n: bytes(t.numpy().tobytes()) for n, t in (data.get("tokenizer") or {}).items()}
        return cls(config=data["config"], prefix=data.get("prefix") or "", tied=tuple(data.get("tied") or ()),
                   generation_config=data.get("generation_config"), tokenizer=files)


def read_hf_record(source, manifest: Manifest) -> HFRecord:
    """The HFRecord a checkpoint holds (the first rank that stored one, with its tokenizer files);
    a CheckpointError saying what to do when it holds none. `source`: the open `Sources`."""
    for info in manifest.ranks:
        if not isinstance(info.extra, Mapping) or EXTRA_KEY not in info.extra:
            continue
        prefix = info.prefix or ""  # a merged source keeps each rank's tensors under rank-0000r/
        data = join_extra(info.extra[EXTRA_KEY], lambda key: source.read_key(info.file, prefix + key))
        return HFRecord.from_extra(data)
    raise CheckpointError(f"{source.root}: the checkpoint records no Hugging Face config (extra[{EXTRA_KEY!r}]), so "
                          f"--hf cannot write config.json: train with model.type nnscaler.trainer.hf.CausalLM (or "
                          f"store nnscaler.ckpt.HFRecord(...).to_extra() in the checkpoint's extra under "
                          f"HF_EXTRA_KEY), or merge without --hf")


def hf_plan(plan: List[tuple], record: HFRecord) -> List[tuple]:
    """`plan` (merge's (stored name, saved names, shape, dtype, bytes) per full tensor) with each
    tensor stored under its Hugging Face name: the prefix stripped, and for tied weights the first
    name (sorted) that transformers does not re-tie on load. Tensors outside the prefix are left
    out (the wrapper's own state, if any)."""
    out, seen = [], {}
    for _, names, shape, dtype, nbytes in plan:
        hf = sorted(n[len(record.prefix):] for n in names if n.startswith(record.prefix))
        if not hf:
            continue
        kept = [n for n in hf if n not in record.tied] or hf
        stored = kept[0]
        if stored in seen:
            raise CheckpointError(f"two tensors of the checkpoint ({seen[stored]} and {names[0]}) are both named "
                                  f"{stored!r} once the prefix {record.prefix!r} is stripped; fix HFRecord.prefix")
        seen[stored] = names[0]
        out.append((stored, names, shape, dtype, nbytes))
    if not out:
        raise CheckpointError(f"no tensor of the checkpoint starts with the recorded prefix {record.prefix!r}: "
                              f"fix HFRecord.prefix (the attribute path of the transformers model, e.g. 'model.')")
    return out


def write_hf_files(stage, record: HFRecord, dtypes: List[str]) -> Dict[str, FileRecord]:
    """config.json (its ``dtype`` set to the weights' when they all have one), the generation
    config and the tokenizer files into the staging directory; returns their manifest records."""
    config = json.loads(record.config)
    if len(set(dtypes)) == 1:
        config["dtype"] = dtypes[0]
        config.pop("torch_dtype", None)
    files = {CONFIG: json.dumps(config, indent=2, sort_keys=True) + "\n"}
    if record.generation_config:
        files[GENERATION_CONFIG] = record.generation_config
    files.update(record.tokenizer)
    records = {}
    for name, data in files.items():
        raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
        with open(stage.file(name), "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        records[name] = bytes_record(raw)
    return records
