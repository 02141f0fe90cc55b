"""The seed's LightningLite example (lightning-lite.rst: BoringModel, SGD, RandomDataset, the
train and validation loops with `all_gather`), on today's Lightning Fabric, with nnscaler.

What differs from the seed's text, and why:
- `LightningLite` is `lightning.fabric.Fabric` (its successor; `run` is overridden the same way);
- `self.setup(model, optimizer)`: Fabric's `setup(module, *optimizers)` takes them positionally;
- `self.all_gather(torch.stack(train_losses))`: `all_gather` of a list returns a list, which has
  no `.mean()` (the seed's line fails with every strategy, DDP included);
- `lite.run(num_epochs, ...)`: the seed's last call forgets `num_epochs`;
- the dataloaders take a `batch_size` (the seed's 1 by default): a tensor-parallel unit of 2
  ranks replaces 2 DDP ranks, so it reads batches of 2 to train like DDP on 2 ranks.
The only change for nnscaler is the strategy argument:

    python examples/lightning/lite_boring.py ddp   # Fabric's DDP on 2 CPU processes
    python examples/lightning/lite_boring.py dp    # nnscaler, data parallel
    python examples/lightning/lite_boring.py tp    # nnscaler, tensor parallel over the 2 processes
"""
import sys

import torch
from lightning.fabric import Fabric as LightningLite
from lightning.fabric import seed_everything
from torch import nn
from torch.utils.data import DataLoader, Dataset


class BoringModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(32, 2)

    def forward(self, x):
        x = self.layer(x)
        return torch.nn.functional.mse_loss(x, torch.ones_like(x))


def configure_optimizers(module: nn.Module):
    return torch.optim.SGD(module.parameters(), lr=0.001)


class RandomDataset(Dataset):
    def __init__(self, length: int, size: int):
        self.len = length
        self.data = torch.randn(length, size)

    def __getitem__(self, index):
        return self.data[index]

    def __len__(self):
        return self.len


def train_dataloader(batch_size=1):
    return DataLoader(RandomDataset(64, 32), batch_size=batch_size)


def val_dataloader(batch_size=1):
    return DataLoader(RandomDataset(64, 32), batch_size=batch_size)


class Lite(LightningLite):
    def run(self, num_epochs, model, train_dataloader, val_dataloader):
        optimizer = configure_optimizers(model)
        model, optimizer = self.setup(model, optimizer)
        train_dataloader = self.setup_dataloaders(train_dataloader)
        val_dataloader = self.setup_dataloaders(val_dataloader)

        for epoch in range(num_epochs):
            train_losses = []
            val_losses = []

            model.train()
            for batch in train_dataloader:
                optimizer.zero_grad()
                loss = model(batch)
                train_losses.append(loss)
                self.backward(loss)
                optimizer.step()

            model.eval()
            with torch.no_grad():
                for batch in val_dataloader:
                    val_losses.append(model(batch))

            train_epoch_loss = self.all_gather(torch.stack(train_losses)).mean()
            val_epoch_loss = self.all_gather(torch.stack(val_losses)).mean()

            print(f"{epoch}/{num_epochs}| Train Epoch Loss: {train_epoch_loss}")
            print(f"{epoch}/{num_epochs}| Valid Epoch Loss: {val_epoch_loss}")


def strategy(kind: str, batch_size: int = 1, gen_savedir: str = "./.nnscaler"):
    """The strategy argument: "ddp" (Fabric's), "dp" or "tp" (nnscaler over every process)."""
    if kind == "ddp":
        return "ddp"
    import torch.distributed as dist
    from nnscaler.ir import ComputeConfig
    from nnscaler.lightning.fabric import NnScalerStrategy
    world = dist.get_world_size() if dist.is_initialized() else 2
    plan = 1 if kind == "dp" else world
    # the tracing input is zeros: drawing it from the seeded RNG would change the data made after it
    return NnScalerStrategy(compute_config=ComputeConfig(plan, world), pas_policy=kind, gen_savedir=gen_savedir,
                            instance_name=f"lite-{kind}", dummy_forward_args={"x": torch.zeros(batch_size, 32)})


if __name__ == "__main__":
    kind = sys.argv[1] if len(sys.argv) > 1 else "dp"
    batch_size = 2 if kind == "tp" else 1
    seed_everything(42)
    lite_model = BoringModel()
    lite = Lite(strategy=strategy(kind, batch_size), devices=2, accelerator="cpu")
    lite.run(10, lite_model, train_dataloader(batch_size), val_dataloader(batch_size))
