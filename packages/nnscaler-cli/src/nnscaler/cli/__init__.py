"""nnscaler.cli: The `nnscaler` command."""
