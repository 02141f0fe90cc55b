"""atomic_write / AtomicFile: the target holds the old content or the whole new one."""
from __future__ import annotations

import pytest

from nnscaler.ir.atomic_write import AtomicFile, atomic_write


def test_write_replaces_whole_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "f.json"
    path.write_text("old")
    atomic_write(path, "new content")
    assert path.read_text() == "new content"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.json"]


def test_failure_midway_keeps_the_old_content(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"old")
    with pytest.raises(RuntimeError):
        with AtomicFile(path) as f:
            f.write(b"half of the new")
            raise RuntimeError("disk full")
    assert path.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.bin"]


def test_pieces_then_commit(tmp_path):
    f = AtomicFile(tmp_path / "g.bin")
    f.write(b"ab")
    f.write(memoryview(b"cd"))
    assert not (tmp_path / "g.bin").exists()  # nothing visible before commit
    f.commit()
    assert (tmp_path / "g.bin").read_bytes() == b"abcd"


def test_exchange_swaps_two_directories_or_says_it_cannot(tmp_path):
    from nnscaler.ir import exchange_paths
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "f").write_text("from a")
    (b / "f").write_text("from b")
    if exchange_paths(a, b):  # Linux with renameat2
        assert (a / "f").read_text() == "from b" and (b / "f").read_text() == "from a"
    else:
        assert (a / "f").read_text() == "from a"  # untouched where unsupported
