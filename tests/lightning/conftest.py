"""The Lightning tests: tests/runtime's helpers (launch) and the helpers here are importable in
this process and in spawned workers."""
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_RUNTIME = os.path.join(os.path.dirname(_HERE), "runtime")
for path in (_HERE, _RUNTIME):
    if path not in sys.path:
        sys.path.insert(0, path)
