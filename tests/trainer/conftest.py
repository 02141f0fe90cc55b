"""The trainer tier: tests/runtime's launch helpers and this folder's models are importable here
and in spawned workers (torchrun children find them through PYTHONPATH, set by `env_with_paths`)."""
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_RUNTIME = os.path.join(os.path.dirname(_HERE), "runtime")
for path in (_HERE, _RUNTIME):
    if path not in sys.path:
        sys.path.insert(0, path)
