"""Built-in policies by name; a user's callable works the same as a name."""
from __future__ import annotations

import dataclasses
import difflib
import importlib
from typing import Callable, Dict, FrozenSet, Iterable, Mapping, Optional, Tuple, Union

from nnscaler.ir import ConfigError, policy_name  # noqa: F401  (policy_name re-exported: the manifest's policy name)

Policy = Callable  # (graph, compute_config) -> graph

_POLICIES: Dict[str, Policy] = {}
_KEYS: Dict[str, Optional[FrozenSet[str]]] = {}  # name -> the pas_config keys it reads (None: not declared)
_CAPS: Dict[str, Tuple[bool, bool]] = {}  # name -> (pipelines, whole_model)

# pas_config keys every policy accepts: apply_policy reads them itself
# read by every plan: recompute_modules (activation recomputation), zero3_units (use_zero=3's
# gather units, read by the runtime: nnscaler.runtime.zero3), zero3_reshard_after_forward (which
# units stay gathered, or held by a smaller group, from forward to backward, read by the runtime:
# contracts.reshard_sizes),
# zero3_mixed_precision (FSDP2's MixedPrecisionPolicy: the dtypes units are gathered and reduced in,
# read by parallelize's trace and the runtime: contracts.mixed_precision)
COMMON_KEYS = frozenset({"recompute_modules", "zero3_units", "zero3_reshard_after_forward", "zero3_mixed_precision"})


@dataclasses.dataclass(frozen=True)
class PolicyInfo:
    """A policy resolved by `resolve_policy`: what to call and what it can do.

    `name`: the registered name, or the function's stable name (`policy_name`); `builtin`: found
    by a registered name; `pipelines`: it may cut the graph into a pipeline (so ``pipeline_nmicros``
    applies); `whole_model`: it pipelines whenever it can, so it needs the whole model end to end
    (a parallelized sub-module cannot use it). A user's function declares neither."""
    name: str
    function: Policy
    builtin: bool = False
    pipelines: bool = False
    whole_model: bool = False


class UnknownPolicyError(ValueError):
    """A policy name that is neither registered nor a fully qualified function name; `known` lists
    the registered names."""

    def __init__(self, name: str, known: list):
        self.name, self.known = name, known
        super().__init__(f"unknown pas_policy {name!r}; built-in policies: {', '.join(known)}, "
                         f"or pass a function (graph, compute_config) -> graph")


def register_policy(name: str, *, keys: Optional[Iterable[str]] = None, pipelines: bool = False,
                    whole_model: bool = False, override: bool = False):
    """Decorator registering a policy function under `name`. A name registered before (a built-in
    policy, or another function) is refused unless ``override=True``; registering the same
    function again (a re-imported module) is allowed.

    `keys`: the ``pas_config`` keys the policy reads. When given, `check_pas_config` refuses
    other keys (besides `COMMON_KEYS` and keys starting with ``_``, which are the user's own).
    `pipelines` / `whole_model`: its capabilities (`PolicyInfo`), asked through `resolve_policy`."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"register_policy needs a policy name (a non-empty string), got {name!r}")

    def deco(fn: Policy) -> Policy:
        old = _POLICIES.get(name)
        if old is not None and not override and policy_name(old) != policy_name(fn):
            raise ValueError(f"register_policy({name!r}): the name is already registered for "
                             f"{policy_name(old)}; pass override=True to replace it, or choose another name")
        _POLICIES[name] = fn
        _KEYS[name] = frozenset(keys) if keys is not None else None
        _CAPS[name] = (bool(pipelines), bool(whole_model))
        return fn
    return deco


def policy_keys(name: str) -> Optional[FrozenSet[str]]:
    """The pas_config keys registered policy `name` reads (with `COMMON_KEYS`), or None when it did not
    declare them."""
    keys = _KEYS.get(name)
    return None if keys is None else keys | COMMON_KEYS


def check_pas_config(policy, pas_config: Mapping) -> None:
    """Refuse pas_config keys the named policy does not read (a typo such as ``{'sed': 3}`` for
    ``seed`` used to be ignored), naming the known keys and the closest one. Keys starting with ``_``
    are the user's own; a policy passed as a function, or one that declared no keys, is not checked."""
    if not isinstance(policy, str) or policy not in _POLICIES:
        return
    known = policy_keys(policy)
    if known is None:
        return
    unknown = sorted(str(k) for k in pas_config if not str(k).startswith("_") and k not in known)
    if not unknown:
        return
    hints = []
    for key in unknown:
        close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
        if close:
            hints.append(f"{close[0]!r} for {key!r}")
    mean = f" Did you mean {', '.join(hints)}?" if hints else ""
    raise ConfigError(f"pas_policy {policy!r} does not know pas_config key(s) {', '.join(map(repr, unknown))}; "
                      f"its keys are {', '.join(sorted(known))} (prefix your own keys with '_').{mean} A key the "
                      f"policy does not read would have no effect")


def available_policies() -> list:
    return sorted(_POLICIES)


def resolve_policy(policy: Union[str, Policy, PolicyInfo]) -> PolicyInfo:
    """The one place a policy argument is validated and resolved: a registered name, a fully
    qualified function name (``pkg.mod.fn``) or a function ``(graph, compute_config) -> graph``.
    Raises `UnknownPolicyError` / ValueError for a name that resolves to nothing, TypeError for
    anything else."""
    if isinstance(policy, PolicyInfo):
        return policy
    if isinstance(policy, str) and policy in _POLICIES:
        pipelines, whole_model = _CAPS.get(policy, (False, False))
        return PolicyInfo(policy, _POLICIES[policy], True, pipelines, whole_model)
    if isinstance(policy, str) and "." in policy:
        module, _, attr = policy.rpartition(".")
        try:
            fn = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"cannot import pas_policy {policy!r}: {e}") from None
        if not callable(fn):
            raise TypeError(f"pas_policy {policy!r} is a {type(fn).__name__}, not a function (graph, compute_config) "
                            f"-> graph")
        policy = fn
    elif isinstance(policy, str):
        raise UnknownPolicyError(policy, available_policies())
    if not callable(policy):
        raise TypeError(f"pas_policy must be a policy name or a callable (graph, compute_config) -> graph, "
                        f"got {type(policy).__name__}")
    return PolicyInfo(policy_name(policy), policy)


def get_policy(policy: Union[str, Policy]) -> Policy:
    """The policy function for a built-in name or a user callable (`resolve_policy`)."""
    return resolve_policy(policy).function
