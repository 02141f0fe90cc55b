"""The multi-process half of the Lite example test: examples/lightning/lite_boring.py run with
Fabric's DDP and with nnscaler's Fabric strategy (dp, tp), recording what `all_gather` returned
(every step's and every validation batch's loss), the trained weights, and the rank Lightning read
when the worker started (tests/runtime/launch.py sets it: the fork server imported Lightning)."""
from __future__ import annotations

import os
import sys

import torch

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                        "examples", "lightning")


def _example():
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)
    import lite_boring
    return lite_boring


def run(rank, world, root, kind, batch_size, epochs):
    ex = _example()
    from lightning_utilities.core.rank_zero import rank_zero_only
    rank_at_start = rank_zero_only.rank  # Lightning's rank before any strategy sets it: the launch's

    class Recording(ex.Lite):
        """The example's Lite, recording what passes through setup and all_gather."""
        gathered = []

        def setup(self, *args, **kwargs):
            self.model, opt = super().setup(*args, **kwargs)
            return self.model, opt

        def all_gather(self, data, *args, **kwargs):
            out = super().all_gather(data, *args, **kwargs)
            self.gathered.append(out.detach().clone())
            return out

    ex.seed_everything(42)
    lite_model = ex.BoringModel()
    lite = Recording(strategy=ex.strategy(kind, batch_size, os.path.join(root, "gen")), devices=world,
                     accelerator="cpu")
    lite.run(epochs, lite_model, ex.train_dataloader(batch_size), ex.val_dataloader(batch_size))
    if kind == "ddp":
        weights = {k: v.detach().clone() for k, v in lite.model.module.state_dict().items()}
    else:
        from lit_models import full_weights

        class Holder(torch.nn.Module):  # full_weights looks for the parallel module here
            pass
        holder = Holder()
        holder.nnscaler_pmodule = lite.model._forward_module
        weights = full_weights(holder)
    return dict(train=lite.gathered[0::2], val=lite.gathered[1::2], weights=weights, rank_at_start=rank_at_start)
