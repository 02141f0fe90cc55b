"""The policy registry: names resolve, a name is never silently overwritten."""
from __future__ import annotations

import pytest

from nnscaler.policies import available_policies, get_policy, register_policy
from nnscaler.policies import registry


def _mine(graph, config):
    return graph


def test_registering_a_taken_name_is_refused_unless_override():
    with pytest.raises(ValueError, match=r"register_policy\('dp'\).*already registered.*override=True"):
        register_policy("dp")(_mine)
    builtin = get_policy("dp")
    try:
        assert register_policy("dp", override=True)(_mine) is _mine
        assert get_policy("dp") is _mine
    finally:
        registry._POLICIES["dp"] = builtin


def test_same_function_again_and_new_names_register():
    try:
        register_policy("tests_mine")(_mine)
        register_policy("tests_mine")(_mine)  # a re-imported module: the same function
        assert "tests_mine" in available_policies() and get_policy("tests_mine") is _mine
    finally:
        registry._POLICIES.pop("tests_mine", None)


def test_bad_name_is_refused():
    with pytest.raises(TypeError, match="policy name"):
        register_policy("")


def test_resolve_policy_gives_what_a_policy_can_do():
    from nnscaler.policies import resolve_policy
    caps = {name: (resolve_policy(name).pipelines, resolve_policy(name).whole_model)
            for name in ("dp", "tp", "pp", "hybrid", "autodist")}
    assert caps == {"dp": (False, False), "tp": (False, False), "pp": (True, True), "hybrid": (True, True),
                    "autodist": (True, False)}
    dotted = resolve_policy("nnscaler.policies.builtin.dp.dp")
    assert dotted.function is get_policy("dp") and not dotted.builtin and not dotted.pipelines
    assert resolve_policy(_mine).function is _mine and resolve_policy(_mine).name.endswith("._mine")
    with pytest.raises(ValueError, match="unknown pas_policy 'nope'"):
        resolve_policy("nope")


def test_registered_capabilities_are_what_resolve_policy_reports():
    from nnscaler.policies import resolve_policy
    try:
        register_policy("_cap_test", pipelines=True, whole_model=True)(_mine)
        info = resolve_policy("_cap_test")
        assert (info.name, info.function, info.builtin, info.pipelines, info.whole_model) == \
            ("_cap_test", _mine, True, True, True)
    finally:
        for table in (registry._POLICIES, registry._KEYS, registry._CAPS):
            table.pop("_cap_test", None)
