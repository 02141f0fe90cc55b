import torch
import torch.distributed as dist

from launch import world1  # noqa: F401  (fixture)
from nnscaler.runtime.device import default_backend, default_device, is_distributed


def test_cpu_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_device() == torch.device("cpu")
    assert default_backend() == "gloo"


def test_cuda_uses_local_rank(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert default_device() == torch.device("cuda", 3)
    assert default_backend() == "nccl"
    monkeypatch.delenv("LOCAL_RANK")
    assert default_device() == torch.device("cuda", 0)


def test_is_distributed(world1):
    assert is_distributed()
    dist.destroy_process_group()
    assert not is_distributed()


def test_not_distributed_without_group():
    assert not is_distributed()
