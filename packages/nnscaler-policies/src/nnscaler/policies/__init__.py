"""nnscaler.policies: how a traced graph is partitioned and placed (PAS policies).

A policy is a function ``(graph, compute_config) -> graph`` built from the primitives `select`,
`partition`, `replicate` and `assign`; built-in policies are found by name (`get_policy`).
"""
from .plan import Piece, PlanError, validate_plan
from .primitives import assign, partition, replicate, select
from .pipeline import cut_stages, pivot_leads, schedule, stage, stage_devices
from .recompute import recompute, recompute_modules
from .registry import (PolicyInfo, UnknownPolicyError, available_policies, check_pas_config, get_policy, policy_keys,
                       policy_name, register_policy, resolve_policy)
from .user_policy import call_policy
from . import builtin as _builtin  # noqa: F401  (registers dp, ...)
from .builtin._nothing_split import PolicyWarning
from .builtin.megatron import MegatronPatternWarning
from .autodist.progress import ProfileProgress, progress_hook, set_progress_hook


def apply_policy(graph, compute_config, policy):
    """Run `policy` (a name or a callable) on `graph` and check the result is a complete plan."""
    fn = get_policy(policy)
    check_pas_config(policy, compute_config.pas_config)  # keys the policy does not read: refused
    result = call_policy(fn, graph, compute_config, policy_name(policy))  # user errors name the user's line
    modules = compute_config.pas_config.get("recompute_modules")
    if modules:  # the config key works with every policy
        recompute_modules(result, modules)
    validate_plan(result, compute_config.plan_ngpus, policy_name(policy))
    if result.pipeline is not None and not compute_config.use_end2end:
        from nnscaler.ir import ConfigError
        raise ConfigError(f"policy {policy_name(policy)!r} made a pipeline, which runs only end to end: set "
                          f"ComputeConfig(use_end2end=True) and call train_step / infer_step (parallel_modules "
                          f"and plain forward calls cannot be pipelined)")
    return result


__all__ = ["Piece", "PolicyInfo", "UnknownPolicyError", "resolve_policy", "PlanError", "PolicyWarning", "ProfileProgress", "progress_hook", "set_progress_hook", "MegatronPatternWarning", "apply_policy", "assign", "available_policies", "check_pas_config", "get_policy", "policy_keys", "partition",
           "policy_name", "cut_stages", "pivot_leads", "schedule", "stage", "stage_devices", "recompute", "recompute_modules", "register_policy", "replicate", "select",
           "validate_plan"]
