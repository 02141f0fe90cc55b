"""`train_in_workers(*argv, cwd=...)`: the worker side of ``nnscaler train <argv>`` (the command's
`main` as each rank under torchrun runs it: config, overrides, prechecks, Trainer) on ``--nproc``
workers forked from the test session's fork server (tests/runtime/launch.py), instead of a launcher,
torchrun and fresh interpreters (3 to 6 s a launch on 2 cores before any training). For tests of what
a run does; the launcher itself is tested through the real command (test_cli.py, test_example.py,
test_fault_tolerance.py, test_worker_env.py). Returns what `subprocess.run` would: the ranks' exit
codes folded into one (the first non-zero), their stdout and stderr each joined in rank order."""
from __future__ import annotations

import subprocess


def _rank(rank, world, argv, cwd):
    import contextlib
    import io
    import os

    from nnscaler.trainer.cli.main import main
    os.environ.update(COLUMNS="200", NO_COLOR="1")  # as test_cli.env() gives the command
    os.chdir(cwd)  # a run's relative paths are the command's working directory's
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))  # RANK is set: no launcher, the Trainer runs here
    return code, out.getvalue(), err.getvalue()


def train_in_workers(*argv, cwd, timeout=300) -> subprocess.CompletedProcess:
    """Run ``nnscaler train <argv>`` (which must say ``--nproc N``) as its N ranks would."""
    from launch import run_workers
    argv = [str(a) for a in argv]
    nproc = int(argv[argv.index("--nproc") + 1])
    ranks = run_workers(_rank, nproc, argv, str(cwd), timeout=timeout)
    code = next((c for c, _, _ in ranks if c), 0)
    return subprocess.CompletedProcess(["nnscaler", "train", *argv], code, "".join(o for _, o, _ in ranks),
                                       "".join(e for _, _, e in ranks))
