"""What a rank holds: a parallelized module's full map, and a container's own tensors."""
import pytest
import torch

from fake_modules import FakeParallel
from nnscaler.ckpt import CheckpointError, load, save
from nnscaler.ckpt.module_tensors import local_tensors, plan_identity
from nnscaler.ir.config import ComputeConfig
from nnscaler.ir.contracts import GeneratedAttrs


class Container(torch.nn.Module):
    def __init__(self, seed):
        super().__init__()
        self.body = FakeParallel(seed=seed)
        torch.manual_seed(seed)
        self.proj = torch.nn.Linear(3, 2)
        self.proj_again = self.proj  # the same module twice: its tensors once


def test_names_persistence_and_aliases():
    by_name = {lt.full_name: lt for lt in local_tensors(Container(0))}
    assert sorted(by_name) == ["body.count", "body.emb.weight", "body.fc.bias", "body.fc.weight", "body.scratch",
                               "proj.bias", "proj.weight"]
    assert by_name["body.emb.weight"].aliases == ("body.head.weight",)
    assert not by_name["body.scratch"].persistent and by_name["body.fc.weight"].trainable
    assert by_name["proj.weight"].aliases == ("proj_again.weight",)
    assert plan_identity(Container(0)) == [{"path": "body", "class": "FakeParallel", "graph_fingerprint": "fake",
                                            "compute_config": ComputeConfig(1, 1).to_dict()}]


def test_a_module_with_a_fullmap_but_not_the_contract_is_not_a_parallelized_module(tmp_path):
    class Lookalike(torch.nn.Module):  # recognised by the IR contract (GeneratedAttrs), not by an attribute
        fullmap = {}
    with pytest.raises(CheckpointError, match="not a parallelized module.*nnscaler.parallelize"):
        save(tmp_path / "ck", Lookalike())

    class Incomplete(GeneratedAttrs, torch.nn.Module):  # the contract, but not the runtime's tensors map
        pass
    with pytest.raises(CheckpointError, match=r"Incomplete \(at the top\) is a generated module without a fullmap"):
        save(tmp_path / "ck", Incomplete())
    assert list(tmp_path.iterdir()) == []


def test_container_round_trip(tmp_path):
    a, b = Container(0), Container(1)
    save(tmp_path / "ck", a)
    load(tmp_path / "ck", b)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
