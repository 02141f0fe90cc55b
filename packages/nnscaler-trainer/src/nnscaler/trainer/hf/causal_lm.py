"""`CausalLM`: a transformers ``AutoModelForCausalLM`` as the Trainer's end2end model.

``forward(batch)`` returns the model's own causal-LM loss (transformers' shift and cross-entropy)
of ``{input_ids, attention_mask?, labels?}``; labels default to the inputs with padding
(``attention_mask == 0``) ignored. As a TrainHook it stores an ``nnscaler.ckpt.HFRecord`` in
every checkpoint (config.json, the ``model.`` prefix, the tied names, the tokenizer's files on
rank 0), from which ``nnscaler ckpt merge SRC DST --hf`` writes a ``from_pretrained`` directory.
Nothing is downloaded: paths are local.
"""
from __future__ import annotations

import json
import os
import tempfile
from typing import Any, Dict, Mapping, Optional

import torch

from nnscaler.ckpt import HF_EXTRA_KEY, HFRecord

from ..errors import TrainerConfigError
from ..hooks import TrainHook

__all__ = ["CausalLM", "import_transformers", "tokenizer_files"]

CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
_DTYPES = ("float32", "float16", "bfloat16", "float64")


def import_transformers(key: str):
    """The transformers module, or a config error naming `key` and the extra to install."""
    try:
        import transformers
    except ImportError:
        raise TrainerConfigError(key, "needs transformers: pip install 'nnscaler-trainer[hf]'") from None
    return transformers


def _local_dir(path: Optional[str], key: str, what: str) -> Optional[str]:
    if path is None:
        return None
    if not os.path.isdir(path):
        raise TrainerConfigError(key, f"{path!r} is not a directory (resolved from {os.getcwd()}): give a local "
                                      f"{what} directory (nothing is downloaded)")
    return path


def tokenizer_files(path: str, key: str) -> Dict[str, bytes]:
    """The files ``AutoTokenizer.from_pretrained(path).save_pretrained`` writes, by name."""
    transformers = import_transformers(key)
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise TrainerConfigError(key, f"{path!r} is not a tokenizer directory transformers can read ({e}); give "
                                      f"a directory holding tokenizer.json (or the files of a slow tokenizer)") from None
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        return {n: open(os.path.join(tmp, n), "rb").read() for n in sorted(os.listdir(tmp))
                if os.path.isfile(os.path.join(tmp, n))}


def _read_generation_config(config: str, from_pretrained: Optional[str]) -> Optional[str]:
    """generation_config.json of the weights' directory, else of the config's; None if neither has one."""
    for folder in (from_pretrained, config if os.path.isdir(config) else None):
        if folder is not None and os.path.isfile(os.path.join(folder, GENERATION_CONFIG)):
            with open(os.path.join(folder, GENERATION_CONFIG), encoding="utf-8") as f:
                return f.read()
    return None


class CausalLM(torch.nn.Module, TrainHook):
    """``model.type: nnscaler.trainer.hf.CausalLM``.

    `config`: a config.json file or a local model directory holding one; `from_pretrained`: a
    local directory whose weights are loaded (else the weights are initialized from the seed);
    `dtype`: the parameters' dtype (``float32`` default, ``bfloat16``, ``float16``, ``float64``);
    `attn_implementation`: transformers' (``sdpa``, ``eager``; None: its default); `tokenizer`: a
    local tokenizer directory copied along by ``merge --hf`` (default: the training dataset's
    ``tokenizer`` when it is a `TokenizedText`). The transformers model is ``self.model``."""

    def __init__(self, config: str, from_pretrained: Optional[str] = None, dtype: str = "float32",
                 attn_implementation: Optional[str] = None, tokenizer: Optional[str] = None):
        super().__init__()
        transformers = import_transformers("model.type")
        if dtype not in _DTYPES:
            raise TrainerConfigError("model.args.dtype", f"{dtype!r} is not one of {', '.join(_DTYPES)}")
        torch_dtype = getattr(torch, dtype)
        if not os.path.isfile(config) and not os.path.isfile(os.path.join(config, CONFIG)):
            raise TrainerConfigError("model.args.config", f"{config!r} is neither a config.json file nor a directory "
                                     f"holding one (resolved from {os.getcwd()}): give a local path (nothing is "
                                     f"downloaded)")
        from_pretrained = _local_dir(from_pretrained, "model.args.from_pretrained", "model")
        self.tokenizer = _local_dir(tokenizer, "model.args.tokenizer", "tokenizer")
        try:
            hf_config = transformers.AutoConfig.from_pretrained(config)
        except (OSError, ValueError, KeyError) as e:
            raise TrainerConfigError("model.args.config", f"transformers cannot read {config!r}: {e}") from None
        kwargs: Dict[str, Any] = {}
        if attn_implementation is not None:
            kwargs["attn_implementation"] = attn_implementation
        recorded = json.loads(hf_config.to_json_string())
        generation = transformers.GenerationConfig.from_model_config(hf_config).to_json_string()
        hf_config.use_cache = False  # training: no key/value cache in the traced graph
        if from_pretrained is not None:
            try:
                self.model = transformers.AutoModelForCausalLM.from_pretrained(
                    from_pretrained, config=hf_config, dtype=torch_dtype, **kwargs)
            except (OSError, ValueError) as e:
                raise TrainerConfigError("model.args.from_pretrained", f"transformers cannot load {from_pretrained!r}: "
                                         f"{e}") from None
        else:
            self.model = transformers.AutoModelForCausalLM.from_config(hf_config, **kwargs).to(torch_dtype)
        recorded["architectures"] = [type(self.model).__name__]
        recorded["dtype"] = dtype
        recorded.pop("torch_dtype", None)
        self._config_json = json.dumps(recorded, indent=2, sort_keys=True)
        self._generation_config = _read_generation_config(config, from_pretrained) or generation
        tied = getattr(self.model, "all_tied_weights_keys", None) or getattr(self.model, "_tied_weights_keys", None)
        self._tied = tuple(sorted(tied or ()))
        self._tokenizer_files: Optional[Dict[str, bytes]] = None

    def forward(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        input_ids = batch["input_ids"]
        mask = batch.get("attention_mask")
        labels = batch.get("labels")
        if labels is None:
            labels = input_ids if mask is None else input_ids.masked_fill(mask == 0, -100)
        return self.model(input_ids=input_ids, attention_mask=mask, labels=labels).loss

    def hf_record(self, trainer=None, with_tokenizer: bool = True) -> HFRecord:
        """What ``merge --hf`` needs (`nnscaler.ckpt.HFRecord`); the tokenizer is `tokenizer`, or
        the trainer's training dataset's when it has one."""
        files: Dict[str, bytes] = {}
        if with_tokenizer:
            if self._tokenizer_files is None:
                path = self.tokenizer or getattr(getattr(trainer, "train_dataset", None), "tokenizer", None)
                key = "model.args.tokenizer" if self.tokenizer else "dataset.train_args.tokenizer"
                self._tokenizer_files = tokenizer_files(path, key) if isinstance(path, str) else {}
            files = self._tokenizer_files
        return HFRecord(config=self._config_json, prefix="model.", tied=self._tied,
                        generation_config=self._generation_config, tokenizer=files)

    def on_save_checkpoint(self, trainer, checkpoint: Dict[str, Any]) -> None:
        checkpoint[HF_EXTRA_KEY] = self.hf_record(trainer, trainer.rank == 0).to_extra()
