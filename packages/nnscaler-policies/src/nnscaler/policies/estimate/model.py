"""The model as the analytic cost model sees it: a decoder-only transformer's widths.

`ModelSpec.from_hf_config` reads a Hugging Face ``config.json`` (any `AutoModelForCausalLM` type),
builds the model on the meta device (no memory, so a trillion parameters cost nothing) to count
its parameters exactly, to tell a gated (SwiGLU) MLP from a plain one, whether the output
embedding is tied, and the class of its decoder layer (the pipeline pivot of the saved plan).
The search itself never walks the model: every cost comes from these numbers.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Optional

from nnscaler.ir import ConfigError

__all__ = ["ModelSpec", "ModelConfigError"]


class ModelConfigError(ConfigError):
    """A model config the estimate cannot use; the message names the file, the field and the fix."""


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    gated: bool = True  # SwiGLU-style MLP: three ffn x hidden matrices, else two
    tied: bool = False  # output projection shares the input embedding
    params: Optional[int] = None  # counted on the meta model; None: the analytic count
    layer_class: str = ""  # the decoder layer's class name
    name: str = ""

    # -------------------------------------------------------------- analytic counts
    @property
    def attn_params(self) -> int:
        return self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)

    @property
    def mlp_params(self) -> int:
        return (3 if self.gated else 2) * self.hidden * self.ffn

    @property
    def layer_params(self) -> int:
        """Matrices of one layer plus its two norms (biases left out)."""
        return self.attn_params + self.mlp_params + 2 * self.hidden

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def total_params(self) -> int:
        if self.params is not None:
            return self.params
        return self.layers * self.layer_params + self.embedding_params * (1 if self.tied else 2) + self.hidden

    def act_elements_per_token(self) -> float:
        """Elements one layer keeps for backward per token (flash attention: no s x s scores): the
        two norms' inputs and outputs, q, k, v and the attention output, the MLP's inner tensors
        (gated: gate, up, act(gate), product; plain: fc1 output and the activation's output)."""
        return 4 * self.hidden + (2 * self.heads + 2 * self.kv_heads) * self.head_dim \
            + (4 if self.gated else 2) * self.ffn

    # -------------------------------------------------------------- reading a config
    @classmethod
    def from_hf_config(cls, path, meta: bool = True) -> "ModelSpec":
        """The spec of the Hugging Face config at `path` (a ``config.json`` or its folder)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except OSError as e:
            raise ModelConfigError(f"cannot read the model config {path}: {e.strerror}; give a Hugging Face "
                                   f"config.json") from None
        except ValueError as e:
            raise ModelConfigError(f"{path} is not valid JSON ({e}); give a Hugging Face config.json") from None
        if not isinstance(raw, dict) or "model_type" not in raw:
            raise ModelConfigError(f"{path} has no 'model_type'; give a Hugging Face config.json (e.g. one saved "
                                   f"by AutoConfig.save_pretrained)")
        try:
            from transformers import AutoConfig
        except ImportError:
            raise ModelConfigError("reading a Hugging Face config needs transformers: pip install transformers") from None
        try:
            config = AutoConfig.for_model(**raw)
        except (ValueError, KeyError, TypeError) as e:
            raise ModelConfigError(f"{path}: transformers cannot build a config from it ({e}); check 'model_type' "
                                   f"and the fields") from None
        return cls.from_config(config, str(path), meta=meta)

    @classmethod
    def from_config(cls, config, where: str = "the config", meta: bool = True) -> "ModelSpec":
        def field(*names, default=None):
            for n in names:
                v = getattr(config, n, None)
                if v is not None:
                    return v
            if default is None:
                raise ModelConfigError(f"{where}: none of {', '.join(repr(n) for n in names)} is set; this estimate "
                                       f"models decoder-only transformers and needs it")
            return default
        experts = [getattr(config, n, None) for n in ("num_local_experts", "num_experts", "n_routed_experts")]
        if any(isinstance(e, int) and e > 1 for e in experts):
            raise ModelConfigError(f"{where}: a mixture-of-experts model ({max(e for e in experts if e)} experts) is "
                                   f"not modelled by the estimate (expert parallelism is not searched); give a dense "
                                   f"model's config")
        hidden = int(field("hidden_size", "n_embd", "d_model"))
        heads = int(field("num_attention_heads", "n_head"))
        head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
        spec = cls(hidden=hidden, layers=int(field("num_hidden_layers", "n_layer")), heads=heads,
                   kv_heads=int(field("num_key_value_heads", default=heads)), head_dim=head_dim,
                   ffn=int(field("intermediate_size", "n_inner", "ffn_dim", default=4 * hidden)),
                   vocab=int(field("vocab_size")), gated=True,
                   tied=bool(getattr(config, "tie_word_embeddings", False)),
                   name=str(getattr(config, "model_type", "")))
        for key, value in (("hidden size", spec.hidden), ("layers", spec.layers), ("heads", spec.heads),
                           ("kv heads", spec.kv_heads), ("vocab", spec.vocab), ("ffn", spec.ffn)):
            if value <= 0:
                raise ModelConfigError(f"{where}: {key} must be > 0, got {value}")
        return _counted(spec, config, where) if meta else spec


def _counted(spec: ModelSpec, config, where: str) -> ModelSpec:
    """`spec` with the meta model's exact parameter count, MLP kind, tying and layer class."""
    import torch
    from transformers import AutoModelForCausalLM
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception as e:  # noqa: BLE001 - any model code failing is the config's problem for the user
        raise ModelConfigError(f"{where}: AutoModelForCausalLM cannot build this config ({type(e).__name__}: {e}); "
                               f"give a causal-LM config") from None
    total = sum(p.numel() for p in model.parameters())
    layers = _layer_list(model, spec.layers)
    if layers is None:
        raise ModelConfigError(f"{where}: no list of {spec.layers} decoder layers found in "
                               f"{type(model).__name__}; the estimate models decoder-only transformers")
    per_layer = sum(p.numel() for p in layers[0].parameters())
    out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    tied = out is not None and inp is not None and out.weight is inp.weight
    # gated or plain MLP: whichever analytic layer count is nearer the real one
    gated = min((True, False), key=lambda g: abs(dataclasses.replace(spec, gated=g).layer_params - per_layer))
    return dataclasses.replace(spec, gated=gated, tied=tied, params=total, layer_class=type(layers[0]).__name__,
                               name=type(model).__name__)


def _layer_list(model, n: int):
    import torch
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == n:
            return module
    return None
