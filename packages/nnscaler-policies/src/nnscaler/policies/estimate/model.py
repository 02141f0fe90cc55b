"""The model as the analytic cost model sees it: a decoder-only transformer's widths.

`ModelSpec.from_hf_config` reads a Hugging Face ``config.json`` (any `AutoModelForCausalLM` type),
builds the model on the meta device (no memory, so a trillion parameters cost nothing) to count
its parameters exactly, to tell a gated (SwiGLU) MLP from a plain one, whether the output
embedding is tied, and the class of its decoder layer (the pipeline pivot of the saved plan).
The search itself never walks the model: every cost comes from these numbers.

Multi-head latent attention (DeepSeek-V2/V3: ``kv_lora_rank``): its projections through the latents and
its q/k and v head widths, which attention's cost and the model FLOPs use.

Mixture of experts: the routed experts E, top-k, one expert's ffn width, the shared experts' total
width and which layers are MoE are read from the config (Mixtral, Qwen2/3-MoE, DeepSeek-V2/V3,
gpt-oss field names); the routed experts' parameters are counted on the meta model (modules named
``experts``), and the active parameters are the total less the unrouted (E - k) / E of them.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Optional, Tuple

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
    # mixture of experts (experts = 0: dense). An MoE layer's MLP: a router (hidden x experts), `experts`
    # routed experts of width `expert_ffn` (top_k of them per token) and shared experts of total width
    # `shared_ffn`; the other layers have the dense MLP of width `ffn`.
    experts: int = 0
    top_k: int = 0
    expert_ffn: int = 0
    shared_ffn: int = 0
    moe_layer_ids: Optional[Tuple[int, ...]] = None  # None: every layer when experts > 0
    routed: Optional[int] = None  # routed experts' parameters counted on the meta model; None: analytic
    # multi-head latent attention (DeepSeek-V2/V3; kv_lora_rank 0: standard attention): q from a q_lora_rank
    # latent (0: projected from the hidden state), every head's k and v from one kv_lora_rank latent, plus one
    # rope_dim key shared by the heads; a head's q and k are qk_head_dim wide, its v v_head_dim (0: head_dim)
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    rope_dim: int = 0
    qk_head_dim: int = 0
    v_head_dim: int = 0

    def __post_init__(self):
        if self.moe_layer_ids is None:
            object.__setattr__(self, "moe_layer_ids", tuple(range(self.layers)) if self.experts else ())

    # -------------------------------------------------------------- attention's shape
    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def qk_dim(self) -> int:
        return self.qk_head_dim or self.head_dim

    @property
    def v_dim(self) -> int:
        return self.v_head_dim or self.head_dim

    @property
    def attn_dim(self) -> float:
        """The head width attention's FLOPs see: QKᵀ runs over qk_dim, PV over v_dim (their mean)."""
        return (self.qk_dim + self.v_dim) / 2

    def attention_projections(self):
        """The attention's matrices as (in, out, split): split ``col`` (the output split over tp, by heads),
        ``row`` (the input split) or ``none`` (MLA's down-projections to the latents: replicated over tp)."""
        h, a, kv, dqk, dv = self.hidden, self.heads, self.kv_heads, self.qk_dim, self.v_dim
        if not self.is_mla:
            return [(h, (a + kv) * dqk + kv * dv, "col"), (a * dv, h, "row")]
        q = [(h, self.q_lora_rank, "none"), (self.q_lora_rank, a * dqk, "col")] if self.q_lora_rank \
            else [(h, a * dqk, "col")]
        return q + [(h, self.kv_lora_rank + self.rope_dim, "none"),
                    (self.kv_lora_rank, a * (dqk - self.rope_dim + dv), "col"), (a * dv, h, "row")]

    @property
    def attn_act_elements(self) -> int:
        """Attention's elements kept for backward a token: q, k, v and the output (MLA: k and v a head's
        each, and the two latents)."""
        a, kv = self.heads, self.kv_heads
        if self.is_mla:
            return self.q_lora_rank + self.kv_lora_rank + self.rope_dim + 2 * a * (self.qk_dim + self.v_dim)
        return (a + kv) * self.qk_dim + (kv + a) * self.v_dim

    @property
    def rotary_elements(self) -> int:
        """Elements rotary embedding reads and writes a token: q and k (MLA: their rope_dim parts)."""
        if self.is_mla:
            return 2 * (self.heads + 1) * self.rope_dim
        return 2 * (self.heads + self.kv_heads) * self.qk_dim

    # -------------------------------------------------------------- analytic counts
    @functools.cached_property  # read per plan priced: the search's inner loop
    def attn_params(self) -> int:
        return sum(i * o for i, o, _ in self.attention_projections())

    @property
    def mlp_params(self) -> int:
        return (3 if self.gated else 2) * self.hidden * self.ffn

    @property
    def layer_params(self) -> float:
        """Matrices of one layer plus its two norms (biases left out); MoE: the mean over the layers."""
        if not self.is_moe:
            return self.dense_layer_params
        return self.layers_params / self.layers

    @property
    def dense_layer_params(self) -> int:
        """A layer with the dense MLP of width `ffn` (every layer of a dense model)."""
        return self.attn_params + self.mlp_params + 2 * self.hidden

    # -------------------------------------------------------------- mixture of experts
    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def moe_layers(self) -> int:
        return len(self.moe_layer_ids)

    @property
    def expert_params(self) -> int:
        """One routed expert's matrices."""
        return (3 if self.gated else 2) * self.hidden * self.expert_ffn

    @property
    def moe_layer_params(self) -> int:
        """An MoE layer's parameters other than the routed experts: attention, norms, router, shared experts."""
        return self.attn_params + 2 * self.hidden + self.hidden * self.experts \
            + (3 if self.gated else 2) * self.hidden * self.shared_ffn

    @property
    def routed_layer_params(self) -> int:
        """An MoE layer's routed experts (analytic)."""
        return self.experts * self.expert_params

    @property
    def layers_params(self) -> int:
        """All decoder layers (analytic)."""
        if not self.is_moe:
            return self.layers * self.layer_params
        return (self.layers - self.moe_layers) * self.dense_layer_params \
            + self.moe_layers * (self.moe_layer_params + self.routed_layer_params)

    @property
    def routed_params(self) -> int:
        """Every routed expert's parameters: counted on the meta model, else analytic."""
        return self.routed if self.routed is not None else self.moe_layers * self.routed_layer_params

    @property
    def active_params(self) -> int:
        """Parameters a token passes through: the total less the unrouted (E - k) / E of the routed experts."""
        if not self.is_moe:
            return self.total_params
        return round(self.total_params - self.routed_params * (self.experts - self.top_k) / self.experts)

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def total_params(self) -> int:
        if self.params is not None:
            return self.params
        return self.layers_params + self.embedding_params * (1 if self.tied else 2) + self.hidden

    def act_elements_per_token(self) -> float:
        """Elements one layer keeps for backward per token (flash attention: no s x s scores): the
        two norms' inputs and outputs, q, k, v and the attention output, the MLP's inner tensors
        (gated: gate, up, act(gate), product; plain: fc1 output and the activation's output)."""
        return 4 * self.hidden + self.attn_act_elements + (4 if self.gated else 2) * self.ffn

    def moe_act_elements_per_token(self, imbalance: float = 1.0) -> float:
        """The same for an MoE layer: the router's logits, the k dispatched copies of the token, the
        top-k experts' inner tensors (x `imbalance` on the busiest rank) and the shared experts'."""
        inner = 4 if self.gated else 2
        return 4 * self.hidden + self.attn_act_elements + self.experts \
            + self.top_k * self.hidden + inner * (self.top_k * self.expert_ffn * imbalance + self.shared_ffn)

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
        spec = _with_mla(_with_experts(spec, config, where), config, where)
        return _counted(spec, config, where) if meta else spec


MLA_FIELDS = ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def _with_mla(spec: ModelSpec, config, where: str) -> ModelSpec:
    """`spec` with multi-head latent attention's widths when the config has a `kv_lora_rank` (DeepSeek-V2/V3)."""
    kv_lora = getattr(config, "kv_lora_rank", None)
    if not kv_lora:
        return spec
    nope, rope, v = (getattr(config, n, None) for n in MLA_FIELDS)
    for name, value in zip(MLA_FIELDS, (nope, rope, v)):
        least = 0 if name == "qk_nope_head_dim" else 1
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ModelConfigError(f"{where}: '{name}' must be a whole number >= {least} with 'kv_lora_rank' set "
                                   f"(multi-head latent attention), got {value!r}; set it in the config")
    # every head gets its own k and v from the latent: as many kv heads as heads (the config's are unused)
    return dataclasses.replace(spec, q_lora_rank=int(getattr(config, "q_lora_rank", None) or 0),
                               kv_lora_rank=int(kv_lora), rope_dim=rope, qk_head_dim=nope + rope, v_head_dim=v,
                               kv_heads=spec.heads)


EXPERT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts")
TOP_K_FIELDS = ("num_experts_per_tok", "experts_per_token")


def _first(config, names):
    """(field name, value) of the first of `names` set on `config`, else (names[0], None)."""
    for n in names:
        v = getattr(config, n, None)
        if v is not None:
            return n, v
    return names[0], None


def _with_experts(spec: ModelSpec, config, where: str) -> ModelSpec:
    """`spec` with the config's mixture-of-experts fields; unchanged for a dense config."""
    e_name, experts = _first(config, EXPERT_FIELDS)
    if not isinstance(experts, int) or isinstance(experts, bool) or experts <= 1:
        return spec
    k_name, top_k = _first(config, TOP_K_FIELDS)
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1:
        raise ModelConfigError(f"{where}: '{k_name}' must be a whole number >= 1 (the experts each token is routed "
                               f"to) for this mixture-of-experts model of {experts} experts ('{e_name}'), got "
                               f"{top_k!r}; set it in the config")
    if top_k > experts:
        raise ModelConfigError(f"{where}: '{k_name}' ({top_k}) exceeds the {experts} routed experts ('{e_name}'); "
                               f"set '{k_name}' to at most {experts}")
    ffn_name, expert_ffn = _first(config, ("moe_intermediate_size", "intermediate_size"))
    if not isinstance(expert_ffn, int) or expert_ffn < 1:
        raise ModelConfigError(f"{where}: '{ffn_name}' (one expert's ffn width) must be a whole number >= 1, got "
                               f"{expert_ffn!r}; set it in the config")
    shared = getattr(config, "shared_expert_intermediate_size", None)
    if shared is None:
        shared = int(getattr(config, "n_shared_experts", None) or 0) * expert_ffn
    return dataclasses.replace(spec, experts=experts, top_k=top_k, expert_ffn=expert_ffn, shared_ffn=int(shared),
                               moe_layer_ids=_moe_layer_ids(config, spec.layers))


def _moe_layer_ids(config, layers: int) -> Tuple[int, ...]:
    """The MoE layers as the transformers models choose them: Qwen-MoE's `mlp_only_layers` and
    `decoder_sparse_step`, DeepSeek's `first_k_dense_replace` and `moe_layer_freq`; else every layer."""
    dense_only = set(getattr(config, "mlp_only_layers", None) or ())
    step = int(getattr(config, "decoder_sparse_step", None) or 1)
    first = int(getattr(config, "first_k_dense_replace", None) or 0)
    freq = int(getattr(config, "moe_layer_freq", None) or 1)
    return tuple(i for i in range(layers) if i not in dense_only and (i + 1) % step == 0 and i >= first
                 and i % freq == 0)


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
    extra = {}
    if spec.is_moe:  # the routed experts: modules named `experts` (shared ones are `shared_expert(s)`)
        routed = {i: sum(p.numel() for name, mod in layer.named_modules() if name.rsplit(".", 1)[-1] == "experts"
                         for p in mod.parameters()) for i, layer in enumerate(layers)}
        if any(routed.values()):
            extra = dict(routed=sum(routed.values()), moe_layer_ids=tuple(i for i, n in routed.items() if n))

    def layer0(s: ModelSpec) -> float:  # the analytic count of layers[0]
        if 0 in s.moe_layer_ids:
            return s.moe_layer_params + s.routed_layer_params
        return s.dense_layer_params

    # gated or plain MLP: whichever analytic layer count is nearer the real one
    gated = min((True, False), key=lambda g: abs(layer0(dataclasses.replace(spec, gated=g)) - per_layer))
    return dataclasses.replace(spec, gated=gated, tied=tied, params=total, layer_class=type(layers[0]).__name__,
                               name=type(model).__name__, **extra)


def _layer_list(model, n: int):
    import torch
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == n:
            return module
    return None
