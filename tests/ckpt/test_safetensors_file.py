"""The streaming safetensors writer: files plain safetensors reads, the SHA-256 of what was
written, kernel copies of byte ranges; specs are enforced."""
import hashlib

import pytest
import torch
from safetensors.torch import load_file

from nnscaler.ckpt.safetensors_file import SafetensorsWriter, dtype_name, read_header, write_tensors


def test_written_files_read_back(tmp_path):
    tensors = {"a": torch.randn(3, 4), "b": torch.arange(5), "c": torch.tensor(2.5, dtype=torch.bfloat16),
               "d": torch.zeros(0, 3), "e": torch.tensor([True, False])}
    size, digest = write_tensors(tmp_path / "f.safetensors", tensors.items(), {"format": "pt"})
    data = (tmp_path / "f.safetensors").read_bytes()
    assert size == len(data) and digest == hashlib.sha256(data).hexdigest()
    back = load_file(tmp_path / "f.safetensors")
    assert all(torch.equal(back[k], v) for k, v in tensors.items())
    assert read_header(tmp_path / "f.safetensors")["__metadata__"] == {"format": "pt"}


def test_copy_of_byte_ranges(tmp_path):
    src = torch.arange(12, dtype=torch.float32)
    write_tensors(tmp_path / "src.safetensors", [("x", src)])
    start = 8 + int.from_bytes((tmp_path / "src.safetensors").read_bytes()[:8], "little")
    path = str(tmp_path / "src.safetensors")
    w = SafetensorsWriter(tmp_path / "out.safetensors", [("y", "F32", (3, 4))])
    w.copy("y", [(path, start + 32, 16), (path, start, 32)])  # elements 8..11 then 0..7
    size, digest = w.close()
    assert digest == hashlib.sha256((tmp_path / "out.safetensors").read_bytes()).hexdigest()
    assert torch.equal(load_file(tmp_path / "out.safetensors")["y"].reshape(-1), torch.cat([src[8:], src[:8]]))


def test_specs_are_enforced(tmp_path):
    w = SafetensorsWriter(tmp_path / "f.safetensors", [("a", "F32", (2,))])
    with pytest.raises(ValueError, match=r"expected a F32\[2\], got a I64\[2\]"):
        w.write("a", torch.arange(2))
    with pytest.raises(ValueError, match="1 tensors were not written"):
        w.close()
    with pytest.raises(TypeError, match="cannot be stored"):
        dtype_name(torch.complex128)
