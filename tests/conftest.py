"""Shared test set-up: the example models are importable as `gpt` (also in spawned workers)."""
import os
import sys

_EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
if _EXAMPLES not in sys.path:
    sys.path.insert(0, _EXAMPLES)
