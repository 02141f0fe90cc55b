"""Built-in policies by name; a user's callable works the same as a name."""
from __future__ import annotations

from typing import Callable, Dict, Union

from nnscaler.ir import policy_name  # noqa: F401  (re-exported: the manifest's policy name)

Policy = Callable  # (graph, compute_config) -> graph

_POLICIES: Dict[str, Policy] = {}


def register_policy(name: str, *, override: bool = False):
    """Decorator registering a policy function under `name`. A name registered before (a built-in
    policy, or another function) is refused unless ``override=True``; registering the same
    function again (a re-imported module) is allowed."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"register_policy needs a policy name (a non-empty string), got {name!r}")

    def deco(fn: Policy) -> Policy:
        old = _POLICIES.get(name)
        if old is not None and not override and policy_name(old) != policy_name(fn):
            raise ValueError(f"register_policy({name!r}): the name is already registered for "
                             f"{policy_name(old)}; pass override=True to replace it, or choose another name")
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


