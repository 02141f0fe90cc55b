"""The model tier: tests/runtime's helpers (launch, parity) are importable here and in spawned
workers; Hugging Face never reaches the network."""
import os
import sys

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
_HERE = os.path.dirname(os.path.abspath(__file__))
_RUNTIME = os.path.join(os.path.dirname(_HERE), "runtime")
for path in (_HERE, _RUNTIME):
    if path not in sys.path:
        sys.path.insert(0, path)
