"""An unusable gen_savedir: one clear line naming the path and the fix, not an OSError traceback."""
from __future__ import annotations

import errno
import os

import pytest
import torch

from nnscaler import ComputeConfig, parallelize
from nnscaler.runtime.errors import GenerationError
from nnscaler.runtime.driver.savedir import savedir_error

from .models import Small


def _parallelize(gen_savedir):
    return parallelize(Small(), {"x": torch.randn(2, 4)}, "dp", ComputeConfig(1, 1, trace_strategy="cpu"),
                       gen_savedir=gen_savedir)


def _assert_one_clean_line(info):
    tb = info.value.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    assert tb.tb_frame.f_code.co_name == "parallelize"  # cut at the user's call: no internal frames
    assert info.value.__cause__ is None and "\n" not in str(info.value)


def test_gen_savedir_that_is_a_file(tmp_path):
    path = tmp_path / "savedir"
    path.write_text("not a directory")
    with pytest.raises(GenerationError) as info:
        _parallelize(path)
    msg = str(info.value)
    assert f"gen_savedir {str(path)!r}" in msg and f"{str(path)!r} is a file, not a directory" in msg
    assert "Pass gen_savedir= a directory path" in msg
    _assert_one_clean_line(info)


def test_gen_savedir_under_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(GenerationError, match=r"is a file, not a directory"):
        _parallelize(tmp_path / "f" / "sub")


def test_gen_savedir_not_writable(tmp_path):
    if os.geteuid() == 0:  # root writes through permission bits: use a path the kernel refuses to root
        path = "/sys/nnscaler_gen"
    else:
        os.chmod(tmp_path, 0o500)
        path = tmp_path / "gen"
    try:
        with pytest.raises(GenerationError) as info:
            _parallelize(path)
    finally:
        os.chmod(tmp_path, 0o700)
    msg = str(info.value)
    assert f"gen_savedir {str(path)!r}" in msg and "not writable" in msg and "writable directory" in msg
    _assert_one_clean_line(info)


def test_no_space_left_is_named(tmp_path):
    exc = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "Small" / "_" / "gencode0.py"))
    err = savedir_error(exc, tmp_path, tmp_path / "Small" / "_")
    assert isinstance(err, GenerationError)
    assert str(err).startswith(f"no space left for gen_savedir {str(tmp_path)!r}") and "another disk" in str(err)


def test_other_oserrors_are_not_rewritten(tmp_path):
    exc = PermissionError(errno.EACCES, "Permission denied", "/etc/somewhere/the_users_file")
    assert savedir_error(exc, tmp_path, tmp_path / "x") is None
    assert savedir_error(ValueError("x"), tmp_path, tmp_path) is None
