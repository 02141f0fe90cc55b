"""Built-in policies; importing this package registers them."""
from . import cp, data, dp, ep, hybrid, megatron, tp  # noqa: F401
from .. import autodist as _autodist  # noqa: F401,E402  (registers autodist)
