"""``python -m nnscaler.cli`` is the ``nnscaler`` command."""
from .main import run

run()
