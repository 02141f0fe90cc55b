"""A command line as the Trainer reads it: ``-f CONFIG`` (``--config``), ``--nproc N``,
``--print-config``, then overrides (``--key value``). `TrainerArgs.from_argv` builds the args from
one; the ``nnscaler train`` command also reads the launcher options."""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from ..errors import TrainerConfigError
from .loading import load_config

__all__ = ["CommandLine", "split_argv"]


@dataclass
class CommandLine:
    """`argv` split into our own options and the config overrides."""

    config: Optional[str] = None
    nproc: Optional[int] = None
    print_config: bool = False
    overrides: List[str] = field(default_factory=list)

    def config_data(self, run_mode: Optional[str] = None) -> Dict[str, Any]:
        """The config file with the overrides applied (and ``--run_mode`` when given), as plain
        data; the modules it names resolve from the working directory and the config's one."""
        if self.config is None:
            raise TrainerConfigError("", "no config file: pass -f CONFIG.yaml")
        _importable_from(os.getcwd(), os.path.dirname(os.path.abspath(self.config)))
        overrides = list(self.overrides) + ([f"--run_mode={run_mode}"] if run_mode is not None else [])
        return load_config(self.config, overrides)


def split_argv(argv: List[str]) -> CommandLine:
    """Our own options out of `argv`; everything else is an override."""
    parsed = CommandLine()
    argv, i = list(argv), 0
    while i < len(argv):
        token = argv[i]
        name, eq, value = token.partition("=")
        if name in ("-f", "--config", "--nproc"):
            if not eq:
                if i + 1 >= len(argv):
                    raise TrainerConfigError("", f"{name} needs a value")
                value, i = argv[i + 1], i + 1
            if name == "--nproc":
                if not value.isdigit() or int(value) < 1:
                    raise TrainerConfigError("", f"--nproc must be a positive integer, got {value!r}")
                parsed.nproc = int(value)
            else:
                parsed.config = value
        elif token == "--print-config":
            parsed.print_config = True
        else:
            parsed.overrides.append(token)
        i += 1
    return parsed


def _importable_from(*dirs: str) -> None:
    """Modules a config names resolve from the working directory and the config's directory
    (as `python -m` finds the working directory's)."""
    for d in reversed(dirs):
        if d not in sys.path:
            sys.path.insert(0, d)
