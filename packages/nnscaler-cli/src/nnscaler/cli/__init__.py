"""nnscaler.cli: the ``nnscaler`` command.

Built-in commands: ``nnscaler info`` (installed nnscaler distributions, torch, distributed
backends, devices) and ``nnscaler --version``. Every other sub-command comes from an installed
package through the entry-point group ``nnscaler.commands``::

    # pyproject.toml of the package that provides `nnscaler ckpt ...`
    [project.entry-points."nnscaler.commands"]
    ckpt = "nnscaler.ckpt.cli:app"      # a typer.Typer: a group of sub-commands
    # or: a plain function, which becomes a single command

Entry points are loaded only when their command runs, so ``nnscaler --help`` stays fast, never
imports torch, and a broken plug-in cannot break it. This package depends on no other nnscaler
package.
"""

ENTRY_POINT_GROUP = "nnscaler.commands"

__all__ = ["ENTRY_POINT_GROUP"]
