"""The plan checks of `CausalLM` made before any worker starts: the experts of a
mixture-of-experts config against ``pas_policy: ep`` / ``cp`` (and ``ep_size``), and what context
parallelism needs of the attention (sdpa, no attention dropout)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

from ..errors import TrainerConfigError


def import_transformers(key: str):
    """The transformers module, or a config error naming `key` and the extra to install."""
    try:
        import transformers
    except ImportError:
        raise TrainerConfigError(key, "needs transformers: pip install 'nnscaler-trainer[hf]'") from None
    return transformers


EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


@dataclass(frozen=True)
class Experts:
    """A mixture-of-experts config's routing: `count` experts per layer (in the config field
    `key`), `top_k` (``num_experts_per_tok``) of them per token."""

    count: int
    top_k: Optional[int]
    key: str


def experts_of(hf_config) -> Optional[Experts]:
    """The routed experts of a transformers config; None for a dense model."""
    for key in EXPERT_KEYS:
        count = getattr(hf_config, key, None)
        if isinstance(count, int) and not isinstance(count, bool) and count > 0:
            top_k = getattr(hf_config, "num_experts_per_tok", None)
            return Experts(count, top_k if isinstance(top_k, int) else None, key)
    return None


def check_experts(hf_config, key: str = "model.args.config") -> Optional[Experts]:
    """`experts_of`, with num_experts_per_tok checked against the experts (a TrainerConfigError
    naming the values and the fix)."""
    experts = experts_of(hf_config)
    if experts is not None and experts.top_k is not None and not 1 <= experts.top_k <= experts.count:
        raise TrainerConfigError(key, f"num_experts_per_tok is {experts.top_k} but the model has {experts.count} "
                                      f"experts ({experts.key}): each token is routed to num_experts_per_tok of "
                                      f"them, so set it between 1 and {experts.count} (or raise {experts.key})")
    return experts


def _check_ep(args, hf_config, experts: Optional[Experts]) -> None:
    """Under ``pas_policy: ep``: experts present and divisible by the expert-parallel size (the
    policy's own refusals, said before any worker starts). Under ``cp`` on a mixture-of-experts model:
    the experts divisible by a stage's devices, over which ``cp`` stores them unless
    ``pas_config['ep_size']`` is 1."""
    from nnscaler.policies import resolve_policy
    policy = resolve_policy(args.pas_policy).name
    if policy == "cp" and experts is not None:
        _check_cp_experts(args, experts)
    if policy != "ep":
        return
    if experts is None:
        raise TrainerConfigError("pas_policy", f"'ep' splits the experts of mixture-of-experts layers, but the "
                                               f"{getattr(hf_config, 'model_type', '?')!r} model of model.args.config "
                                               f"has none (no {' / '.join(EXPERT_KEYS)}): use dp, tp or another "
                                               f"policy for a dense model, or give a mixture-of-experts config")
    cc = args.compute_config
    pp = (cc.pas_config or {}).get("pp_size", 1)
    pp = pp if isinstance(pp, int) and pp > 0 else 1
    ep = cc.plan_ngpus // pp  # any ep_size but 1 stores the experts over all of a stage's devices
    if ep > 1 and experts.count % ep and (cc.pas_config or {}).get("ep_size") != 1:
        sizes = [n for n in range(2, experts.count + 1) if experts.count % n == 0][:4]
        how = f"plan_ngpus {' or '.join(str(n * pp) for n in sizes)}" if sizes else "another plan"
        raise TrainerConfigError("compute_config.plan_ngpus",
                                 f"is {cc.plan_ngpus}: pas_policy 'ep' splits each layer's {experts.count} experts "
                                 f"({experts.key}) over the expert-parallel size {ep} (plan_ngpus"
                                 f"{f' / pp_size {pp}' if pp > 1 else ''}), which does not divide {experts.count}: "
                                 f"use {how} (an expert-parallel size dividing {experts.count}; runtime_ngpus a "
                                 f"multiple of plan_ngpus), or a model whose expert count {ep} divides")


def _check_cp_experts(args, experts: Experts) -> None:
    cc = args.compute_config
    pas = cc.pas_config or {}
    pp = pas.get("pp_size", 1)
    pp = pp if isinstance(pp, int) and pp > 0 else 1
    devices = cc.plan_ngpus // pp
    ep = pas.get("ep_size", devices)
    # any ep_size above 1 stores the experts over all of a stage's devices (the groups only exchange tokens)
    if isinstance(ep, int) and not isinstance(ep, bool) and ep > 1 and experts.count % devices:
        raise TrainerConfigError("compute_config.pas_config.ep_size",
                                 f"is {ep}{'' if 'ep_size' in pas else ' (a stage of plan_ngpus / pp_size devices)'}: "
                                 f"pas_policy 'cp' splits each layer's {experts.count} experts ({experts.key}) over "
                                 f"the {devices} devices of a stage, which does not divide {experts.count}: set "
                                 f"pas_config.ep_size to 1 (every expert on every device), or use plan_ngpus / pp_size "
                                 f"dividing {experts.count}")


def cp_size(args) -> int:
    """The context-parallel size of `args` (TrainerArgs) under ``pas_policy: cp``: the devices of a
    pipeline stage, plan_ngpus / pp_size; 0 under any other policy."""
    from nnscaler.policies import resolve_policy
    if resolve_policy(args.pas_policy).name != "cp":
        return 0
    cc = args.compute_config
    pp = (cc.pas_config or {}).get("pp_size", 1)
    pp = pp if isinstance(pp, int) and not isinstance(pp, bool) and pp > 0 else 1
    return max(1, cc.plan_ngpus // pp)


def attention_dropouts(hf_config) -> Dict[str, float]:
    """The config's non-zero attention dropouts by field (``attention_dropout``, GPT-2's
    ``attn_pdrop``, BERT's ``attention_probs_dropout_prob``, ...)."""
    out = {}
    for name, value in sorted(hf_config.to_dict().items()):
        low = name.lower()
        if ("attn" in low or "attention" in low) and "drop" in low and isinstance(value, (int, float)) \
                and not isinstance(value, bool) and value:
            out[name] = value
    return out


def _causal_lm_class(hf_config):
    transformers = import_transformers("model.type")
    try:
        return transformers.AutoModelForCausalLM._model_mapping[type(hf_config)]
    except (KeyError, ValueError):
        return None  # AutoModelForCausalLM names the problem when the model is built


def _check_cp(args, config, hf_config) -> None:
    """Under ``pas_policy: cp``: sdpa attention, no attention dropout (the policy's and ring
    attention's refusals, said before any worker starts)."""
    cp = cp_size(args)
    if not cp:
        return
    where = "config.json" if isinstance(config, str) else "the mapping"
    requested = _model_args(args).get("attn_implementation")
    own = getattr(hf_config, "_attn_implementation_internal", None)
    if requested is not None and requested != "sdpa":
        raise TrainerConfigError("model.args.attn_implementation",
                                 f"is {requested!r}, but pas_policy 'cp' runs every attention as ring attention, "
                                 f"which needs it as one torch.nn.functional.scaled_dot_product_attention call: set "
                                 f"it to sdpa (--model.args.attn_implementation sdpa), or leave it unset (sdpa is "
                                 f"transformers' default), or use another policy")
    if requested is None and own is not None and own != "sdpa":
        raise TrainerConfigError("model.args.config",
                                 f"asks for attn_implementation {own!r} ({where}), but pas_policy 'cp' runs every "
                                 f"attention as ring attention, which needs it as one "
                                 f"torch.nn.functional.scaled_dot_product_attention call: set model.args."
                                 f"attn_implementation to sdpa (or drop attn_implementation from {where})")
    model_class = _causal_lm_class(hf_config)
    if model_class is not None and not getattr(model_class, "_supports_sdpa", False):
        raise TrainerConfigError("pas_policy",
                                 f"'cp' runs every attention as ring attention, which needs it as one "
                                 f"torch.nn.functional.scaled_dot_product_attention call, but transformers' "
                                 f"{model_class.__name__} has no sdpa attention (it computes attention op by op): "
                                 f"use dp, tp or another policy for this model")
    dropouts = attention_dropouts(hf_config)
    if dropouts:
        name, value = next(iter(dropouts.items()))
        fix = (f"--model.args.config.{name} 0" if not isinstance(config, str)
               else f"{name}: 0.0 in {config!r}'s config.json, or give the config as a mapping")
        raise TrainerConfigError("model.args.config",
                                 f"{name} is {value} but pas_policy 'cp' runs attention as ring attention, which "
                                 f"has no attention dropout: set {name} to 0 ({fix}), or use another policy")


def _model_args(args) -> Dict[str, Any]:
    from ..config.values import build_args
    return build_args(args.model.args, "model.args")
