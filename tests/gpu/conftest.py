"""The gpu tier: tests/runtime's helpers (launch, parity, toy_models), tests/lightning's and the
examples are importable here and in spawned workers."""
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_TESTS = os.path.dirname(_HERE)
for path in (_HERE, os.path.join(_TESTS, "runtime"), os.path.join(_TESTS, "lightning")):
    if path not in sys.path:
        sys.path.insert(0, path)
