"""Built-in policies; importing this package registers them."""
from . import dp  # noqa: F401
