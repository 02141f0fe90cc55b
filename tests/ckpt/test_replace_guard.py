"""What `merge` / `convert` (and `nnscaler ckpt merge --overwrite`) may replace: only an empty
directory or an earlier merge output, never a directory holding anything else, never one that
contains the source or lies inside it. Every refusal leaves the disk exactly as it was."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from fake_modules import trained
from nnscaler.ckpt import CheckpointError, convert, merge, save, verify
from nnscaler.cli.main import app


def _snapshot(root):
    """Every path under `root` (and `root` itself) with its bytes (None for a directory)."""
    return {str(p.relative_to(root.parent)): (None if p.is_dir() else p.read_bytes())
            for p in [root, *sorted(root.rglob("*"))]}


@pytest.fixture
def run_dir(tmp_path):
    """A training run directory: a checkpoint under checkpoints/last, generated code, logs, notes."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    pm, opt = trained()
    save(run / "checkpoints" / "last", pm, opt, extra={"step": 2})
    (run / "gen").mkdir()
    (run / "gen" / "gencode0.py").write_text("# generated\n")
    (run / "tensorboard").mkdir()
    (run / "tensorboard" / "events.out").write_bytes(b"\x00\x01events")
    (run / "notes.txt").write_text("lr 1e-3 looked best\n")
    return run


def test_overwrite_of_a_run_directory_holding_the_source_is_refused(run_dir):
    before = _snapshot(run_dir)
    with pytest.raises(CheckpointError, match=r"run contains the source .*last: replacing it would delete the "
                                              r"source; choose a new destination"):
        merge(run_dir / "checkpoints" / "last", run_dir, overwrite=True)
    assert _snapshot(run_dir) == before
    assert sorted(p.name for p in run_dir.parent.iterdir()) == ["run"]  # no staging directory either


def test_cli_overwrite_of_the_run_directory_is_refused_in_one_line(run_dir):
    before = _snapshot(run_dir)
    out = CliRunner().invoke(app, ["ckpt", "merge", str(run_dir / "checkpoints" / "last"), str(run_dir),
                                   "--overwrite"], env={"COLUMNS": "400", "NO_COLOR": "1"})
    assert out.exit_code == 1, out.output
    lines = [line for line in out.output.splitlines() if line.strip()]
    assert lines == [lines[0]] and lines[0].startswith("Error:") and str(run_dir) in lines[0], out.output
    assert "Traceback" not in out.output
    assert _snapshot(run_dir) == before


def test_overwrite_of_a_directory_that_is_no_merge_output_is_refused(run_dir, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine\n")
    before = _snapshot(other)
    with pytest.raises(CheckpointError, match=r"other is not the output of an earlier merge .*holds notes.txt.*"
                                              r"choose a new destination"):
        merge(run_dir / "checkpoints" / "last", other, overwrite=True)
    assert _snapshot(other) == before


def test_overwrite_of_a_training_checkpoint_is_refused(run_dir, tmp_path):
    pm, opt = trained(seed=4)
    sharded = save(tmp_path / "sharded", pm, opt)
    before = _snapshot(sharded)
    with pytest.raises(CheckpointError, match="sharded is not the output of an earlier merge"):
        merge(run_dir / "checkpoints" / "last", sharded, overwrite=True)
    assert _snapshot(sharded) == before


def test_overwrite_of_a_merge_output_with_foreign_files_is_refused(run_dir, tmp_path):
    merged = merge(run_dir / "checkpoints" / "last", tmp_path / "merged")
    (merged / "config.json").write_text("{}")
    before = _snapshot(merged)
    with pytest.raises(CheckpointError, match="merged holds config.json, which no merge wrote: --overwrite would "
                                              "delete it"):
        merge(run_dir / "checkpoints" / "last", merged, overwrite=True)
    assert _snapshot(merged) == before


def test_a_manifest_rewrite_left_midway_does_not_block_an_overwrite(run_dir, tmp_path):
    """A kill while the after-commit thread rewrites manifest.json leaves manifest.json.tmp: the
    checkpoint's own file, not a user's, so overwriting that checkpoint still works."""
    pm, opt = trained()
    ckpt = tmp_path / "ckpt"
    save(ckpt, pm, opt, extra={"step": 1})
    (ckpt / "manifest.json.tmp").write_text('{"partial')
    save(ckpt, pm, opt, extra={"step": 2}, overwrite=True)
    assert verify(ckpt) and not (ckpt / "manifest.json.tmp").exists()


def test_overwrite_of_a_file_or_a_link_is_refused(run_dir, tmp_path):
    src = run_dir / "checkpoints" / "last"
    (tmp_path / "file").write_text("data")
    with pytest.raises(CheckpointError, match="file is a file, not an earlier merge output"):
        merge(src, tmp_path / "file", overwrite=True)
    assert (tmp_path / "file").read_text() == "data"
    merged = merge(src, tmp_path / "merged")
    (tmp_path / "link").symlink_to(merged)
    with pytest.raises(CheckpointError, match="link is a symbolic link"):
        merge(src, tmp_path / "link", overwrite=True)
    assert (tmp_path / "link").resolve() == merged and verify(merged)


@pytest.mark.parametrize("overwrite", [False, True])
def test_destination_inside_or_equal_to_the_source_is_refused(run_dir, overwrite):
    src = run_dir / "checkpoints" / "last"
    before = _snapshot(run_dir)
    for dst in (src / "merged", src):
        with pytest.raises(CheckpointError, match=r"lies inside the source .*last: .* choose a destination outside"):
            merge(src, dst, overwrite=overwrite)
    assert _snapshot(run_dir) == before


def test_overwrite_replaces_an_earlier_merge(run_dir, tmp_path):
    merged = merge(run_dir / "checkpoints" / "last", tmp_path / "merged")
    pm, opt = trained(seed=9)
    newer = save(tmp_path / "newer", pm, opt)
    merge(newer, merged, overwrite=True)
    assert verify(merged)["merged_from"]["path"] == str(newer)
    assert torch.equal(load_file(merged / "model.safetensors")["fc.weight"], pm.fc_weight.detach())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged", "newer", "run"]  # the old one is gone


def test_overwrite_fills_an_empty_directory(run_dir, tmp_path):
    (tmp_path / "empty").mkdir()
    merge(run_dir / "checkpoints" / "last", tmp_path / "empty", overwrite=True)
    assert verify(tmp_path / "empty")["kind"] == "merged"


def test_a_destination_that_changes_during_the_merge_is_kept(run_dir, tmp_path):
    merged = merge(run_dir / "checkpoints" / "last", tmp_path / "merged")

    def meddle(done, total, name):  # a file appears in the destination while the merge runs
        (merged / "notes.txt").write_text("written meanwhile\n")
    before = {**_snapshot(merged), "merged/notes.txt": b"written meanwhile\n"}
    with pytest.raises(CheckpointError, match="merged holds notes.txt, which no merge wrote"):
        merge(run_dir / "checkpoints" / "last", merged, overwrite=True, progress=meddle)
    assert _snapshot(merged) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged", "run"]  # the staged merge was removed


def test_convert_into_the_directory_of_its_source_is_refused(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    save_file({"w": torch.ones(2)}, hf / "model.safetensors")
    (hf / "config.json").write_text("{}")
    before = _snapshot(hf)
    with pytest.raises(CheckpointError, match="hf contains the source"):
        convert(hf / "model.safetensors", hf, overwrite=True)
    with pytest.raises(CheckpointError, match="lies inside the source"):
        convert(hf, hf, overwrite=True)
    assert _snapshot(hf) == before


def test_save_overwrite_replaces_only_a_checkpoint(run_dir, tmp_path):
    """`save(..., overwrite=True)` (what the Lightning strategies call) may replace an earlier
    checkpoint or an empty directory, never a directory holding anything else."""
    pm, opt = trained()
    before = _snapshot(run_dir)
    with pytest.raises(CheckpointError, match=r"run is not the output of an earlier checkpoint save .*overwrite=True "
                                              r"replaces only such a directory; choose a new destination"):
        save(run_dir, pm, opt, overwrite=True)
    assert _snapshot(run_dir) == before
    assert sorted(p.name for p in run_dir.parent.iterdir()) == ["run"]  # no staging directory either

    last = run_dir / "checkpoints" / "last"
    (last / "mine.txt").write_text("keep me\n")
    with pytest.raises(CheckpointError, match=r"holds mine.txt, which no checkpoint save wrote"):
        save(last, pm, opt, overwrite=True)
    (last / "mine.txt").unlink()

    save(last, pm, opt, extra={"step": 3}, overwrite=True)  # an earlier checkpoint is replaced
    verify(last)
    empty = tmp_path / "empty"
    empty.mkdir()
    save(empty, pm, opt, overwrite=True)
    verify(empty)
