"""A small ResNet-18-style model for the in-place and BatchNorm tests (torchvision is not installed).

`ResNet` stacks torchvision's `BasicBlock` (conv-bn-relu-conv-bn + shortcut, ``ReLU(inplace=True)``)
in four stages of two blocks, like ResNet-18, at a width and image size small enough for CPU
tests. ``forward(image, label)`` returns the cross-entropy loss.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False),
                                            nn.BatchNorm2d(cout))

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    """ResNet-18's layout (stem, 4 stages x 2 BasicBlocks, average pool, linear head), tiny."""

    def __init__(self, widths=(4, 8, 8, 16), classes: int = 4, in_channels: int = 3):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, widths[0], 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        layers, cin = [], widths[0]
        for i, w in enumerate(widths):
            stride = 1 if i == 0 else 2
            layers.append(nn.Sequential(BasicBlock(cin, w, stride), BasicBlock(w, w)))
            cin = w
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(cin, classes)

    def forward(self, image, label):
        x = self.maxpool(self.relu(self.bn1(self.conv1(image))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        x = torch.flatten(self.avgpool(x), 1)
        return F.cross_entropy(self.fc(x), label)


def resnet_batch(step: int, n: int, size: int = 16):
    g = torch.Generator().manual_seed(500 + step)
    return {"image": torch.randn(n, 3, size, size, generator=g), "label": torch.randint(0, 4, (n,), generator=g)}


def resnet_batch64(step: int, n: int) -> dict:
    """`resnet_batch` with its floating tensors in float64 (the parity tests' precision)."""
    return {k: v.double() if v.is_floating_point() else v for k, v in resnet_batch(step, n).items()}


def train_reference(steps: int, n: int, make_opt, training: bool = True, eval_after: bool = False):
    """One process: `steps` SGD steps of the float64 ResNet seeded with 0 on `resnet_batch64`
    batches of `n`; returns (losses, state_dict). `eval_after` appends one eval-mode loss."""
    torch.manual_seed(0)
    model = ResNet().double().train(training)
    opt = make_opt(model.parameters())
    losses = []
    for step in range(steps):
        loss = model(**resnet_batch64(step, n))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    if eval_after:
        model.eval()
        with torch.no_grad():
            losses.append(model(**resnet_batch64(steps, n)).item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
