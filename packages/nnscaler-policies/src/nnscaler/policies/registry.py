"""Built-in policies by name; a user's callable works the same as a name."""
from __future__ import annotations

from typing import Callable, Dict, Union

Policy = Callable  # (graph, compute_config) -> graph

_POLICIES: Dict[str, Policy] = {}


def register_policy(name: str):
    """Decorator registering a policy function under `name`."""
    def deco(fn: Policy) -> Policy:
        _POLICIES[name] = fn
        return fn
    return deco


def available_policies() -> list:
    return sorted(_POLICIES)


def get_policy(policy: Union[str, Policy]) -> Policy:
    """The policy function for a built-in name or a user callable."""
    if callable(policy):
        return policy
    if not isinstance(policy, str):
        raise TypeError(f"pas_policy must be a policy name or a callable (graph, compute_config) -> graph, "
                        f"got {type(policy).__name__}")
    if policy not in _POLICIES:
        import importlib
        if "." in policy:  # a fully qualified function name, as the Trainer passes them
            module, _, attr = policy.rpartition(".")
            try:
                return getattr(importlib.import_module(module), attr)
            except (ImportError, AttributeError) as e:
                raise ValueError(f"cannot import pas_policy {policy!r}: {e}") from None
        raise ValueError(f"unknown pas_policy {policy!r}; built-in policies: {', '.join(available_policies())}, "
                         f"or pass a function (graph, compute_config) -> graph")
    return _POLICIES[policy]


def policy_name(policy: Union[str, Policy]) -> str:
    """A stable name for a policy (recorded in the gen_savedir manifest)."""
    if isinstance(policy, str):
        return policy
    return f"{getattr(policy, '__module__', '?')}.{getattr(policy, '__qualname__', repr(policy))}"
