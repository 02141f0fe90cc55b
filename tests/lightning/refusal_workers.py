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


class Temperature(Classifier):
    """A parameter the traced forward does not use, used in training_step (rule 1)."""
    def __init__(self, no_grad: bool = False):
        super().__init__()
        self.temperature = torch.nn.Parameter(torch.full((), 2.0))
        self.no_grad = no_grad

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.no_grad:  # allowed: a constant for this step
            with torch.no_grad():
                t = self.temperature * 1.0
            self.seen = t.item()
        else:
            t = self.temperature
        return torch.nn.functional.cross_entropy(self(x) / t, y)


class Scaled(Classifier):
    """A parameter held by the LightningModule itself and used in forward; read under no_grad
    after each step (the trained value), or used with grad enabled in training_step."""
    def __init__(self, misuse: bool = False):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.full((), 1.5))
        self.misuse = misuse

    def forward(self, x):
        return self.net(x) * self.scale

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self(x), y)
        return loss + (self.scale ** 2 if self.misuse else 0.0)


class FromBatch(Base):
    """Tracing input from the first training batch."""
    def dummy_forward_args_fn(self, batch):
        return {"x": batch[0]}


def _fit(root, name, model, plan_ngpus=1, runtime=None, config=None, **trainer_kwargs):
    from nnscaler.ir import ComputeConfig
    from nnscaler.lightning import NnScalerStrategy
    cfg = ComputeConfig(plan_ngpus, runtime or dist.get_world_size(), **(config or {}))
    strategy = NnScalerStrategy(compute_config=cfg, pas_policy="dp", gen_savedir=os.path.join(root, "gen"),
                                instance_name=name)
    t = trainer(strategy, os.path.join(root, name), max_epochs=1, **trainer_kwargs)
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
        "param_outside_forward": lambda: _fit(root, "i", Temperature()),
        "direct_param_outside_forward": lambda: _fit(root, "j", Scaled(misuse=True)),
    }
    out = {name: error_of(fn) for name, fn in cases.items()}
    model = FromBatch()
    t = _fit(root, "from_batch", model)
    out["from_batch_steps"] = t.global_step
    model = Temperature(no_grad=True)
    t = _fit(root, "no_grad", model)
    out["no_grad"] = (t.global_step, model.seen, type(model.temperature).__name__)
    model = Scaled()
    _fit(root, "scaled", model)
    with torch.no_grad():
        read = model.scale * 1.0
    trained = dict(model.nnscaler_pmodule.named_parameters())
    trained = [v for k, v in trained.items() if model.nnscaler_pmodule.fullmap[k].full_name == "scale"][0]
    out["scaled"] = (read.item(), trained.item())
    return out
