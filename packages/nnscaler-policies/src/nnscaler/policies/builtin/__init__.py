"""Built-in policies; importing this package registers them."""
from . import data, dp, megatron, tp  # noqa: F401
