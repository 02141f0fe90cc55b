"""The atomic commit: a directory appears whole or not at all; an existing one is never replaced
unless asked, and then atomically; a directory being written is never taken for a checkpoint."""
from __future__ import annotations

import pytest

from nnscaler.ckpt import CheckpointError
from nnscaler.ckpt.commit import StagingDir, abandoned_siblings, new_token
from nnscaler.ckpt.manifest import read_manifest
from nnscaler.ckpt.names import FORMAT, FORMAT_VERSION, is_staging

MANIFEST = {"format": FORMAT, "format_version": FORMAT_VERSION, "kind": "sharded", "world_size": 1, "files": {}}


def _write(dest, text, overwrite=False):
    stage = StagingDir(dest, new_token(), overwrite).create()
    stage.file("data.txt").write_text(text)
    return stage


def test_commit_moves_the_directory_into_place(tmp_path):
    stage = _write(tmp_path / "ck", "one")
    assert is_staging(stage.path.name) and not (tmp_path / "ck").exists()
    stage.commit(MANIFEST)
    assert (tmp_path / "ck" / "data.txt").read_text() == "one"
    assert read_manifest(tmp_path / "ck")["kind"] == "sharded"
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]


def test_existing_destination_is_refused_and_kept(tmp_path):
    _write(tmp_path / "ck", "one").commit(MANIFEST)
    with pytest.raises(CheckpointError, match=r"ck already exists: choose a new path, or pass overwrite=True"):
        _write(tmp_path / "ck", "two")
    assert (tmp_path / "ck" / "data.txt").read_text() == "one"
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]


def test_overwrite_replaces_whole(tmp_path):
    _write(tmp_path / "ck", "one").commit(MANIFEST)
    _write(tmp_path / "ck", "two", overwrite=True).commit(MANIFEST)
    assert (tmp_path / "ck" / "data.txt").read_text() == "two"
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]


def test_a_directory_still_being_written(tmp_path):
    stage = _write(tmp_path / "ck", "one")  # never committed: a save in progress, or a crash
    with pytest.raises(CheckpointError, match=r"still being written.*wait for the save to finish"):
        read_manifest(stage.path)
    with pytest.raises(CheckpointError, match=r"ck does not exist; a save into it did not finish"):
        read_manifest(tmp_path / "ck")
    assert abandoned_siblings(tmp_path / "ck") == [stage.path]
    with pytest.raises(CheckpointError, match="reserved for checkpoints being written"):
        StagingDir(stage.path, new_token()).create()
    stage.discard()
    assert list(tmp_path.iterdir()) == []


def test_missing_parent(tmp_path):
    with pytest.raises(CheckpointError, match=r"parent directory does not exist; create it first"):
        StagingDir(tmp_path / "a" / "ck", new_token()).create()
