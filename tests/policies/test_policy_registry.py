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
