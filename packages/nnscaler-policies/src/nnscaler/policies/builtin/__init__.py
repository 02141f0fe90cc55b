"""Built-in policies; importing this package registers them."""
from . import data, dp, hybrid, megatron, tp  # noqa: F401
