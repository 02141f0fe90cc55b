"""Small single-device models used by the parallelize tests (importable by spawned workers)."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from nnscaler import register_op


class MLP(nn.Module):
    def __init__(self, dim: int = 16, nlayers: int = 3):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(nlayers))

    def forward(self, x, y):
        for layer in self.layers:
            x = F.gelu(layer(x))
        return F.mse_loss(x.sum(-1), y)


def mlp_batch(step: int, n: int, dim: int = 16):
    g = torch.Generator().manual_seed(step)
    return {"x": torch.randn(n, dim, generator=g), "y": torch.randn(n, generator=g)}


class TiedFrozen(nn.Module):
    """A tied encoder/decoder weight and a frozen (requires_grad=False) projection."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.enc = nn.Linear(dim, 8, bias=False)
        self.dec = nn.Linear(8, dim, bias=False)
        self.dec.weight = nn.Parameter(torch.randn(dim, 8) * 0.3)
        self.enc.weight = nn.Parameter(self.dec.weight.detach().t().contiguous())
        self.head = nn.Linear(8, 8, bias=False)
        self.tail = nn.Linear(8, 8, bias=False)
        self.tail.weight = self.head.weight  # tied: one tensor, two names
        self.frozen = nn.Linear(dim, dim)
        self.frozen.requires_grad_(False)
        self.shared = nn.Linear(dim, dim)
        self.shared_again = self.shared  # the same module under two names

    def forward(self, x, y):
        h = self.tail(torch.tanh(self.head(torch.tanh(self.enc(x)))))
        x = self.dec(h) + self.frozen(x)
        x = self.shared_again(torch.relu(self.shared(x)))
        return F.mse_loss(x.sum(-1), y)


@register_op("b d^, d^ -> b d^")
def scaled_cumsum(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """A custom op: registered with an annotation, recorded as one node, imported by generated code."""
    return torch.cumsum(x, dim=-1) * scale


class CustomOpModel(nn.Module):
    def __init__(self, dim: int = 16):
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, dim))

    def forward(self, x, y):
        h = scaled_cumsum(self.fc(x), self.scale)
        h = torch.logcumsumexp(h, dim=-1)  # an op with no annotation: runs replicated
        return F.mse_loss(h.sum(-1), y)


class SmallCNN(nn.Module):
    """conv -> relu -> max-pool -> conv -> relu -> avg-pool -> flatten -> linear -> cross-entropy."""

    def __init__(self, classes: int = 4):
        super().__init__()
        self.conv1 = nn.Conv2d(2, 4, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(4, 8, kernel_size=3, padding=1)
        self.head = nn.Linear(8 * 2 * 2, classes)

    def forward(self, image, label):
        h = F.max_pool2d(F.relu(self.conv1(image)), 2)
        h = F.avg_pool2d(F.relu(self.conv2(h)), 2)
        return F.cross_entropy(self.head(torch.flatten(h, 1)), label)


def cnn_batch(step: int, n: int):
    g = torch.Generator().manual_seed(100 + step)
    return {"image": torch.randn(n, 2, 8, 8, generator=g), "label": torch.randint(0, 4, (n,), generator=g)}


class FanOut(nn.Module):
    """One tensor read by three ops that the `fan_out_policy` gives three different layouts."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.fc1 = nn.Linear(dim, dim)
        self.fc2 = nn.Linear(dim, dim)

    def forward(self, x, y):
        h = torch.tanh(x)
        return F.mse_loss((self.fc1(h) + self.fc2(h) + h * 2).sum(-1), y)


def fan_out_policy(graph, cfg):
    """fc1 column-parallel (reads h replicated), fc2 split on the batch (reads h split), the rest
    replicated: h's gradient comes back from three layouts and must add up."""
    from nnscaler.policies import assign, partition, replicate
    n = cfg.plan_ngpus
    for node in graph.nodes:
        if node.module_path == "fc1":
            pieces = partition(graph, node, "n", n)
        elif node.module_path == "fc2":
            pieces = partition(graph, node, "b0", n)
        else:
            pieces = replicate(graph, node, n)
        for device, piece in enumerate(pieces):
            assign(piece, device)
    return graph


class SumMLP(MLP):
    """The MLP with a loss summed over the samples (tokens), for grad_reduction='per-token-mean'."""

    def forward(self, x, y):
        for layer in self.layers:
            x = F.gelu(layer(x))
        return F.mse_loss(x.sum(-1), y, reduction="sum")


class Distill(nn.Module):
    """A student fitting its targets and a teacher's outputs computed under torch.no_grad(): the
    teacher gets no gradient (and so no update) however the plan splits its ops."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.teacher = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, dim))
        self.student = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, dim))

    def forward(self, x, y):
        with torch.no_grad():
            target = self.teacher(x)
        h = self.student(x)
        return F.mse_loss(h.sum(-1), y) + F.mse_loss(h, target)
