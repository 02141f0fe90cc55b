"""The multi-process half of the refusal tests: every configuration NnScalerStrategy refuses,
each tried through a real Trainer.fit on the gloo ranks; what each raised is returned."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from launch import error_of
from lit_models import Base, Classifier, FEATURES, trainer


class TwoOptimizers(Classifier):
    """Lightning allows several optimizers with manual optimization only."""
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def configure_optimizers(self):
        return [torch.optim.Adam(self.net[0].parameters()), torch.optim.Adam(self.net[2].parameters())]


class TwoSchedulers(Classifier):
    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters())
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, 1), torch.optim.lr_scheduler.StepLR(opt, 2)]


class TwoGroups(Classifier):
    def configure_optimizers(self):
        return torch.optim.Adam([{"params": self.net[0].parameters(), "lr": 1e-3},
                                 {"params": list(self.net[2].parameters()) + list(self.net[4].parameters())}])


class Subset(Classifier):
    def configure_optimizers(self):
        return torch.optim.Adam(self.net[0].parameters())


class NoDummy(Base):
    pass


class NotADict(Classifier):
    @property
    def dummy_forward_args(self):
        return [torch.randn(8, FEATURES)]


class UsesModuleOutsideForward(Classifier):
    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)  # rule 3: only through forward


class FromBatch(Base):
    """Tracing input from the first training batch."""
    def dummy_forward_args_fn(self, batch):
        return {"x": batch[0]}


def _fit(root, name, model, plan_ngpus=1, runtime=None):
    from nnscaler.ir import ComputeConfig
    from nnscaler.lightning import NnScalerStrategy
    cfg = ComputeConfig(plan_ngpus, runtime or dist.get_world_size())
    strategy = NnScalerStrategy(compute_config=cfg, pas_policy="dp", gen_savedir=os.path.join(root, "gen"),
                                instance_name=name)
    t = trainer(strategy, os.path.join(root, name), max_epochs=1)
    t.fit(model)
    return t


def refusals(rank, world, root):
    cases = {
        "two_optimizers": lambda: _fit(root, "a", TwoOptimizers()),
        "two_schedulers": lambda: _fit(root, "b", TwoSchedulers()),
        "two_groups": lambda: _fit(root, "c", TwoGroups()),
        "subset": lambda: _fit(root, "d", Subset()),
        "no_dummy": lambda: _fit(root, "e", NoDummy()),
        "not_a_dict": lambda: _fit(root, "f", NotADict()),
        "world": lambda: _fit(root, "g", Classifier(), runtime=4),
        "outside_forward": lambda: _fit(root, "h", UsesModuleOutsideForward()),
    }
    out = {name: error_of(fn) for name, fn in cases.items()}
    model = FromBatch()
    t = _fit(root, "from_batch", model)
    out["from_batch_steps"] = t.global_step
    return out
