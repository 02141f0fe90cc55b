"""What `nnscaler.trainer.hf.CausalLM` checks in a transformers config before any worker starts,
beyond the plan's rules (``causal_lm.py``):

- `unread_config_keys`: the keys of a ``model.args.config`` mapping that the model's config class
  does not read. transformers stores such a key in config.json and ignores it, so a typo or an
  option of ours put there (``capacity_factor``) would be silently dropped: `warn_unread_config_keys`
  warns, naming each key and, for our own options, the key that sets them.
- `check_train_only_randomness`: a router's ``router_jitter_noise`` (Mixtral's, ...) runs in training
  mode only, behind a Python branch on ``self.training``; the generated code follows the mode it was
  traced in (training), so a run that validates would fail at its first validation. Refused before
  any step, naming the two fixes.
"""
from __future__ import annotations

import dataclasses
import difflib
import inspect
import warnings
from typing import Any, List, Mapping

from ..errors import TrainerConfigError, TrainerConfigWarning

__all__ = ["OUR_OPTIONS", "unread_config_keys", "warn_unread_config_keys", "check_train_only_randomness"]

# options of CausalLM a user may put into the transformers config by mistake
OUR_OPTIONS = ("capacity_factor", "load_balance_coeff", "dtype", "attn_implementation", "tokenizer", "pretrained",
               "from_pretrained")
# config.json keys transformers reads itself or converts (legacy names), whatever the class
_READ_BY_TRANSFORMERS = {"model_type", "transformers_version", "architectures", "torch_dtype", "dtype", "rope_theta",
                         "rope_scaling", "_name_or_path", "attn_implementation", "_attn_implementation",
                         "experts_implementation", "_experts_implementation", "output_attentions"}


def _read_keys(cls) -> set:
    names = set(_READ_BY_TRANSFORMERS)
    if dataclasses.is_dataclass(cls):
        names |= {f.name for f in dataclasses.fields(cls)}
    for klass in cls.__mro__:
        if "__init__" in klass.__dict__:
            try:
                names |= set(inspect.signature(klass.__init__).parameters)
            except (TypeError, ValueError):
                pass
    amap = getattr(cls, "attribute_map", None) or {}
    names |= set(amap) | set(amap.values())
    try:
        names |= set(cls().to_dict())  # what __post_init__ sets
    except Exception:  # a class without defaults: its signature and fields only
        pass
    return names


def unread_config_keys(config: Mapping[str, Any]) -> List[str]:
    """The keys of `config` (config.json's fields, ``model_type`` among them) that its transformers
    config class neither declares nor sets: stored in config.json and ignored by the model."""
    import transformers
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in transformers.CONFIG_MAPPING:
        return []  # load_hf_config names an unknown model_type
    cls = transformers.CONFIG_MAPPING[model_type]  # (a lazy mapping: no .get)
    read = _read_keys(cls)
    return sorted(k for k in config if k not in read and not isinstance(getattr(cls, k, None), property))


def warn_unread_config_keys(config: Any, key: str = "model.args.config") -> List[str]:
    """Warn once per key of a `config` mapping that the config class does not read (see the module
    docstring); returns those keys. A path (config.json) is not checked: it is transformers' own."""
    if not isinstance(config, Mapping):
        return []
    unread = unread_config_keys(config)
    if not unread:
        return []
    import transformers
    cls = transformers.CONFIG_MAPPING[config["model_type"]]
    read = sorted(_read_keys(cls))
    for name in unread:
        if name in OUR_OPTIONS:
            fix = (f"it is an option of nnscaler.trainer.hf.CausalLM, not of the model's config: set "
                   f"model.args.{name} (--model.args.{name} {config[name]!r})")
        else:
            close = difflib.get_close_matches(name, read, n=2)
            fix = (f"did you mean {' or '.join(close)}?" if close else
                   f"check the spelling against {cls.__name__}'s fields")
        warnings.warn(f"{key}.{name}: transformers' {cls.__name__} does not read {name!r}; it would be stored in "
                      f"config.json and ignored by the model: {fix}", TrainerConfigWarning, stacklevel=2)
    return unread


def check_train_only_randomness(args, hf_config) -> None:
    """Refuse ``router_jitter_noise`` > 0 in a run that validates (``dataset.val_args``): the
    router's jitter is a branch on ``self.training`` the generated code cannot follow in eval mode."""
    jitter = getattr(hf_config, "router_jitter_noise", None)
    if not isinstance(jitter, (int, float)) or isinstance(jitter, bool) or not jitter > 0:
        return
    if not getattr(args.dataset, "val_args", None):
        return  # no validation: the traced training-mode forward is all the run uses
    raise TrainerConfigError("model.args.config",
                             f"router_jitter_noise is {jitter}: the router multiplies its input by random noise "
                             f"in training mode only (a Python branch on self.training), and nnscaler's generated "
                             f"code follows the mode it was traced in (training), so the first validation "
                             f"(dataset.val_args) would fail after the training before it: set router_jitter_noise "
                             f"to 0 (--model.args.config.router_jitter_noise 0), or train without validation "
                             f"(remove dataset.val_args)")
