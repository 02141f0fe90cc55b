"""`CausalLM`: a transformers ``AutoModelForCausalLM`` as the Trainer's end2end model.

``forward(batch)`` returns the model's own causal-LM loss (transformers' shift and cross-entropy)
of ``{input_ids, attention_mask?, labels?, position_ids?, cu_seqlens?}``; labels default to the
inputs with padding (``attention_mask == 0``) and each packed document's first token ignored. Packed
documents as ``cu_seqlens`` (or transformers' ``cu_seq_lens_q``) become ``position_ids`` (packed.py). As a TrainHook it stores an ``nnscaler.ckpt.HFRecord`` in
every checkpoint (config.json, the ``model.`` prefix, the tied names, the tokenizer's files on
rank 0), from which ``nnscaler ckpt merge SRC DST --hf`` writes a ``from_pretrained`` directory.
Nothing is downloaded: paths are local.

Mixture-of-experts configs (experts in ``num_local_experts`` / ``num_experts`` /
``n_routed_experts``, ``num_experts_per_tok`` routed per token): when the architecture returns
router logits, forward asks for them and returns ``(loss, aux_loss)``: the loss is transformers'
own with labels, the next-token loss plus ``router_aux_loss_coef * aux_loss`` (the router's
load-balancing loss); the Trainer logs ``aux_loss`` (`nnscaler.trainer.MoEModel`). The config is
checked before any worker starts (`CausalLM.validate_trainer_args`): top-k against the experts,
and under ``pas_policy: ep`` experts present and divisible by the expert-parallel size.

Long context (``pas_policy: cp``, context parallelism: every op split along the sequence, attention
as ring attention): the attention must be one ``F.scaled_dot_product_attention`` call, so
`attn_implementation` must be ``sdpa`` (unset: transformers' default, sdpa for every architecture
that has it) and the architecture must have sdpa attention; the attention dropout must be 0.
`validate_trainer_args` refuses the rest before any worker starts (the sequence length is
`TokenizedText.validate_trainer_args`'s check).
"""
from __future__ import annotations

import inspect
import json
import logging
import os
import tempfile
from typing import Any, Dict, Mapping, Optional, Tuple, Union

import torch

from nnscaler.ckpt import HF_EXTRA_KEY, HFRecord, is_hf_directory

from ..errors import TrainerConfigError
from ..hooks import TrainHook
from ..meta_build import MetaBuilt, cpu_init_needed
from ..moe import MoEModel
from .config_keys import check_train_only_randomness, warn_unread_config_keys
from .packed import check_cu_seqlens, cu_seqlens_of, position_ids_from_cu_seqlens
from .plan_checks import (Experts, _check_cp, _check_ep, _model_args, attention_dropouts, check_experts, cp_size,
                          experts_of, import_transformers)

_logger = logging.getLogger(__name__)

__all__ = ["CausalLM", "Experts", "attention_dropouts", "cp_size", "experts_of", "import_transformers",
           "load_hf_config", "tokenizer_files"]

CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
_DTYPES = ("float32", "float16", "bfloat16", "float64")



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


def load_hf_config(config: Union[str, Mapping[str, Any]], key: str = "model.args.config"):
    """The transformers config `config` names: a config.json file, a local directory holding one,
    or a mapping of config.json's fields (``model_type`` required)."""
    transformers = import_transformers("model.type")
    if isinstance(config, Mapping):
        fields = dict(config)
        model_type = fields.pop("model_type", None)
        if not isinstance(model_type, str):
            raise TrainerConfigError(key, "a config given as a mapping needs model_type (e.g. mixtral, llama): the "
                                          "fields of a config.json")
        try:
            return transformers.AutoConfig.for_model(model_type, **fields)
        except (ValueError, TypeError, KeyError) as e:
            raise TrainerConfigError(key, f"transformers cannot build a {model_type!r} config from the mapping: "
                                          f"{e}") from None
    if not isinstance(config, str) or (not os.path.isfile(config) and not os.path.isfile(os.path.join(config, CONFIG))):
        raise TrainerConfigError(key, f"{config!r} is neither a config.json file nor a directory holding one "
                                      f"(resolved from {os.getcwd()}): give a local path (nothing is downloaded) or "
                                      f"the config's fields as a mapping")
    try:
        return transformers.AutoConfig.from_pretrained(config)
    except (OSError, ValueError, KeyError) as e:
        raise TrainerConfigError(key, f"transformers cannot read {config!r}: {e}") from None




def _weights_argument(pretrained: Optional[str], from_pretrained: Optional[str]) -> Tuple[str, Optional[str]]:
    """(the config key, the path) of the pretrained weights; both names at once are refused."""
    if pretrained is not None and from_pretrained is not None:
        raise TrainerConfigError("model.args.pretrained", "and model.args.from_pretrained are the same setting "
                                                          "(from_pretrained is its older name): give one")
    return ("model.args.pretrained", pretrained) if pretrained is not None else \
        ("model.args.from_pretrained", from_pretrained)


def _routes_aux_loss(model_class, hf_config) -> bool:
    """The architecture returns router logits and adds router_aux_loss_coef * aux_loss to its loss."""
    return (hasattr(hf_config, "router_aux_loss_coef")
            and "output_router_logits" in inspect.signature(model_class.forward).parameters)


def _set_capacity_factor(model, capacity_factor) -> None:
    key = "model.args.capacity_factor"
    if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float)) or not capacity_factor > 0:
        raise TrainerConfigError(key, f"{capacity_factor!r} is not a number > 0: each expert keeps at most "
                                      f"ceil(capacity_factor x tokens x top-k / experts) token slots (e.g. 1.25); "
                                      f"leave it out (null) for dropless routing")
    from nnscaler.ir import set_capacity_factor
    if not set_capacity_factor(model, float(capacity_factor)):
        raise TrainerConfigError(key, f"{type(model).__name__} has no experts module nnscaler routes (a transformers "
                                      f"class marked use_experts_implementation): a capacity applies to "
                                      f"mixture-of-experts models only; remove capacity_factor")


def _balance_coeff(model, coeff) -> Optional[float]:
    if coeff is None:
        return None
    key = "model.args.load_balance_coeff"
    if isinstance(coeff, bool) or not isinstance(coeff, (int, float)) or not coeff >= 0:
        raise TrainerConfigError(key, f"{coeff!r} is not a number >= 0: the step each router bias moves by after "
                                      f"every optimizer step (e.g. 0.001); leave it out (null) for no balancing")
    from nnscaler.runtime import moe as runtime_moe
    BIAS_NAME = runtime_moe.BIAS_NAME
    if not any(name.endswith("." + BIAS_NAME) for name, _ in model.named_buffers()):
        raise TrainerConfigError(key, f"{type(model).__name__} has no router bias ({BIAS_NAME}, DeepSeek-V3's) to "
                                      f"balance: auxiliary-loss-free balancing applies to such models only; remove "
                                      f"load_balance_coeff")
    return float(coeff)


def _read_generation_config(config: Union[str, Mapping[str, Any]],
                            from_pretrained: Optional[str]) -> Optional[str]:
    """generation_config.json of the weights' directory, else of the config's; None if neither has one."""
    for folder in (from_pretrained, config if isinstance(config, str) and os.path.isdir(config) else None):
        if folder is not None and os.path.isfile(os.path.join(folder, GENERATION_CONFIG)):
            with open(os.path.join(folder, GENERATION_CONFIG), encoding="utf-8") as f:
                return f.read()
    return None


class CausalLM(torch.nn.Module, TrainHook, MoEModel, MetaBuilt):
    """``model.type: nnscaler.trainer.hf.CausalLM``.

    `config`: a config.json file, a local model directory holding one, or config.json's fields as a
    mapping (``{model_type: mixtral, hidden_size: 64, ...}``); `pretrained` (or its older name
    `from_pretrained`): a local directory whose weights are loaded (else the weights are
    initialized from the seed). Under a plan that shards parameters (``plan_ngpus > 1`` or
    ``use_zero: 3``) the Trainer builds the model on the meta device and each rank loads only its
    shards from the directory's safetensors (`builds_on_meta`, `nnscaler.ckpt.load`); otherwise
    transformers' ``from_pretrained`` loads it whole on every rank;
    `dtype`: the parameters' dtype (``float32`` default, ``bfloat16``, ``float16``, ``float64``);
    `attn_implementation`: transformers' (``sdpa``, ``eager``; None: its default); `tokenizer`: a
    local tokenizer directory copied along by ``merge --hf`` (default: the training dataset's
    ``tokenizer`` when it is a `TokenizedText`). The transformers model is ``self.model``.

    A mixture-of-experts model whose architecture returns router logits (Mixtral, Qwen2/3-MoE,
    OLMoE, gpt-oss, ...) returns ``(loss, aux_loss)``: `aux_loss_output` is 1 (see the module
    docstring); `experts` is its `Experts` (None for a dense model). `capacity_factor` (off by
    default: dropless) makes its experts drop the token slots beyond ceil(capacity_factor x tokens x
    top-k / experts) per expert and forward call (GShard / Switch; docs/moe.md).
    `load_balance_coeff` (DeepSeek-V3's auxiliary-loss-free balancing; off by default): after each
    step every router's ``e_score_correction_bias`` moves by it toward balance
    (`nnscaler.runtime.moe.balance_experts`; needs ``pas_policy: ep``)."""

    def __init__(self, config: Union[str, Mapping[str, Any]], from_pretrained: Optional[str] = None,
                 dtype: str = "float32", attn_implementation: Optional[str] = None, tokenizer: Optional[str] = None,
                 pretrained: Optional[str] = None, capacity_factor: Optional[float] = None,
                 load_balance_coeff: Optional[float] = None):
        super().__init__()
        transformers = import_transformers("model.type")
        if dtype not in _DTYPES:
            raise TrainerConfigError("model.args.dtype", f"{dtype!r} is not one of {', '.join(_DTYPES)}")
        torch_dtype = getattr(torch, dtype)
        hf_config = load_hf_config(config)
        key, from_pretrained = _weights_argument(pretrained, from_pretrained)
        from_pretrained = _local_dir(from_pretrained, key, "model")
        on_meta = torch.get_default_device().type == "meta"  # the Trainer's choice (builds_on_meta)
        self.tokenizer = _local_dir(tokenizer, "model.args.tokenizer", "tokenizer")
        self.experts = check_experts(hf_config)
        kwargs: Dict[str, Any] = {}
        if attn_implementation is not None:
            kwargs["attn_implementation"] = attn_implementation
        recorded = json.loads(hf_config.to_json_string())
        generation = transformers.GenerationConfig.from_model_config(hf_config).to_json_string()
        hf_config.use_cache = False  # training: no key/value cache in the traced graph
        if from_pretrained is not None and on_meta:  # filled after parallelize, shard by shard
            if not is_hf_directory(from_pretrained):
                raise TrainerConfigError(key, f"{from_pretrained!r} holds no model.safetensors (nor its index "
                                              f"model.safetensors.index.json), which a plan that shards parameters "
                                              f"reads shard by shard: save it with save_pretrained(safe_serialization"
                                              f"=True), or convert it (nnscaler ckpt convert)")
            self.model = transformers.AutoModelForCausalLM.from_config(hf_config, **kwargs).to(torch_dtype)
            self.weights_to_load = from_pretrained
        elif from_pretrained is not None:
            try:
                self.model = transformers.AutoModelForCausalLM.from_pretrained(
                    from_pretrained, config=hf_config, dtype=torch_dtype, **kwargs)
            except (OSError, ValueError) as e:
                raise TrainerConfigError(key, f"transformers cannot load {from_pretrained!r}: {e}") from None
        elif on_meta:  # initialized on each rank after parallelize (runtime/driver/meta_init.py)
            model = transformers.AutoModelForCausalLM.from_config(hf_config, **kwargs)
            why = cpu_init_needed(model, torch_dtype)
            if why is not None:  # replaying its initialisation on the ranks would give other values
                _logger.warning("nnscaler: building %s on the CPU of every rank, not on the meta device: %s",
                                type(model).__name__, why)
                with torch.device("cpu"):
                    model = transformers.AutoModelForCausalLM.from_config(hf_config, **kwargs)
            self.model = model.to(torch_dtype)
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
        self.aux_loss_output = 1 if self.experts is not None and _routes_aux_loss(type(self.model), hf_config) else None
        if capacity_factor is not None:
            _set_capacity_factor(self.model, capacity_factor)
        self.load_balance_coeff = _balance_coeff(self.model, load_balance_coeff)

    @classmethod
    def builds_on_meta(cls, args) -> bool:
        """Under a plan that shards parameters (tensor or pipeline parallel, ``use_zero: 3``) of the
        whole model: build on meta, then each rank loads its shards of `pretrained`, or without it
        initializes them (the CPU build's values; not with ``tracing_from_weights``, nor for a
        mixture of experts: transformers' router counts pick histc's dtype by device, int32 on meta,
        which the CPU cannot run)."""
        margs = _model_args(args)
        cc = args.compute_config
        if args.uses_parallel_modules or not (cc.plan_ngpus > 1 or cc.zero_stage == 3):
            return False
        if (margs.get("pretrained") or margs.get("from_pretrained")) is not None:
            return True
        config = margs.get("config")
        return args.tracing_from_weights is None and config is not None and \
            check_experts(load_hf_config(config)) is None

    @classmethod
    def validate_trainer_args(cls, args) -> None:
        """Before any worker starts (`TrainerArgs.validate`): the config loads, num_experts_per_tok
        fits the experts, under ``pas_policy: ep`` the model has experts that split over the
        expert-parallel size (plan_ngpus / pp_size), and under ``pas_policy: cp`` the attention is
        sdpa without dropout; no ``router_jitter_noise`` in a run that validates. Raises
        TrainerConfigError. Warns for each key of a config mapping its class does not read."""
        config = _model_args(args).get("config")
        if config is None:
            return  # instantiate() names the missing argument
        hf_config = load_hf_config(config)
        experts = check_experts(hf_config)
        warn_unread_config_keys(config)  # a key the config class ignores (config_keys.py)
        check_train_only_randomness(args, hf_config)
        if not args.uses_parallel_modules:
            _check_ep(args, hf_config, experts)
            _check_cp(args, config, hf_config)

    def forward(self, batch: Mapping[str, torch.Tensor]) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        input_ids = batch["input_ids"]
        mask = batch.get("attention_mask")
        labels = batch.get("labels")
        if labels is None:
            labels = input_ids if mask is None else input_ids.masked_fill(mask == 0, -100)
        positions = batch.get("position_ids")  # packed documents (TokenizedText pack: true): restarting per document
        cu_seqlens = cu_seqlens_of(batch)  # packed documents as flash attention's boundaries (packed.py)
        if positions is None and cu_seqlens is not None:
            positions = position_ids_from_cu_seqlens(cu_seqlens, tuple(input_ids.shape))
        if positions is not None and batch.get("labels") is None:  # no document's last token predicts the next one's first
            labels = labels.masked_fill(positions == 0, -100)
        if self.aux_loss_output is None:
            return self.model(input_ids=input_ids, attention_mask=mask, labels=labels, position_ids=positions).loss
        # transformers adds router_aux_loss_coef * aux_loss to the loss when labels are given
        out = self.model(input_ids=input_ids, attention_mask=mask, labels=labels, position_ids=positions,
                         output_router_logits=True)
        return out.loss, out.aux_loss.detach()

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

    def on_train_step_start(self, trainer, batches) -> None:
        """Packed documents given as ``cu_seqlens`` (or ``cu_seq_lens_q``) are checked before the step
        (`packed.check_cu_seqlens`: forward only computes with them)."""
        for i, batch in enumerate(batches):
            if isinstance(batch, Mapping):
                check_cu_seqlens(batch, f"train micro-batch {i}")

    def on_val_step_start(self, trainer, batches) -> None:
        for i, batch in enumerate(batches):
            if isinstance(batch, Mapping):
                check_cu_seqlens(batch, f"validation micro-batch {i}")

    def on_save_checkpoint(self, trainer, checkpoint: Dict[str, Any]) -> None:
        checkpoint[HF_EXTRA_KEY] = self.hf_record(trainer, trainer.rank == 0).to_extra()
