"""The worker of test_gpu_lightning.py: Lightning on the one GPU, in a one-rank process."""
from __future__ import annotations

import os

import torch

from gpu_support import HAS_CUDA, no_tf32

ACCELERATOR = "gpu" if HAS_CUDA else "cpu"


def _run(root, name, strategy):
    from lit_models import Classifier, full_weights, trainer
    model = Classifier(batch_size=8, optimizer="sgd")
    t = trainer(strategy, os.path.join(root, name), accelerator=ACCELERATOR, devices=1)
    t.fit(model)
    if name == "lightning":
        weights = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    else:
        weights = {k: v.cpu() for k, v in full_weights(model).items()}
    return t, model, dict(losses=torch.stack(model.step_losses).cpu(), weights=weights)


def fit(rank, world, root):
    """Lightning's DDP on the one device, then NnScalerStrategy (dp) without and with cpu_offload."""
    from nnscaler.ir import ComputeConfig
    from nnscaler.lightning import NnScalerStrategy
    from nnscaler.lightning.model_setup import pmodule_of
    out = {}
    with no_tf32():
        from lightning.pytorch.strategies import DDPStrategy
        _, _, out["lightning"] = _run(root, "lightning", DDPStrategy())  # as tests/lightning compare
        for name, offload in (("nnscaler", False), ("offload", True)):
            strategy = NnScalerStrategy(compute_config=ComputeConfig(1, 1), pas_policy="dp",
                                        gen_savedir=os.path.join(root, "gen"), instance_name=name,
                                        cpu_offload=offload)
            t, model, res = _run(root, name, strategy)
            pm = pmodule_of(model)
            opt = t.strategy.optimizers[0]
            states = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
            copies = list(getattr(opt, "offload_copies", []) or [])
            res.update(param_devices={p.device.type for p in pm.parameters()},
                       state_devices={v.device.type for v in states}, n_states=len(states),
                       offloaded=hasattr(opt, "offload_copies"), n_copies=len(copies),
                       copies_pinned=[c.is_pinned() for c in copies])
            out[name] = res
    return out
