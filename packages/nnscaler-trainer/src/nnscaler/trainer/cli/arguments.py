"""The command line of ``nnscaler train`` / ``nnscaler compile`` / ``python -m nnscaler.trainer``:
``-f CONFIG`` (``--config``), ``--nproc N``, ``--print-config``, then overrides."""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import List, Optional

from ..config.loading import load_config
from ..config.trainer_args import TrainerArgs
from ..errors import TrainerConfigError

__all__ = ["ParsedArgs", "parse_argv", "split_argv"]


@dataclass
class ParsedArgs:
    config: Optional[str]
    nproc: Optional[int] = None
    print_config: bool = False
    overrides: List[str] = field(default_factory=list)
    train_args: Optional[TrainerArgs] = None


def split_argv(argv: List[str]) -> ParsedArgs:
    """Our own options out of `argv`; everything else is an override."""
    parsed = ParsedArgs(config=None)
    i = 0
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


def parse_argv(argv: List[str], run_mode: Optional[str] = None) -> ParsedArgs:
    """Split `argv`, load the config with its overrides and build validated TrainerArgs."""
    parsed = split_argv(list(argv))
    if parsed.config is None:
        raise TrainerConfigError("", "no config file: pass -f CONFIG.yaml")
    _importable_from(os.getcwd(), os.path.dirname(os.path.abspath(parsed.config)))
    overrides = list(parsed.overrides)
    if run_mode is not None:
        overrides += [f"--run_mode={run_mode}"]
    parsed.train_args = TrainerArgs.from_dict(load_config(parsed.config, overrides))
    return parsed
