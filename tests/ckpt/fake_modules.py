"""Stand-ins for parallelized modules in single-process tests: a module with the contract the
checkpoint package reads (a `GeneratedAttrs` subclass, so ``COMPUTE_CONFIG`` is typed and
``GRAPH_FINGERPRINT`` declared; ``fullmap`` of ``FullMapEntry``, tensors as attributes,
``full_aliases``, as the runtime's ``ParallelModule`` has them), holding the whole model, and its
single-device twin."""
from __future__ import annotations

import torch
import torch.nn as nn

from nnscaler.ir.contracts import FullMapEntry, GeneratedAttrs


class Plain(nn.Module):
    """The single-device model: an embedding tied to the head, a linear, a counter buffer and a
    non-persistent buffer."""

    def __init__(self, seed: int = 0, dim: int = 4, vocab: int = 6):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(vocab, dim)
        self.fc = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("count", torch.tensor(seed, dtype=torch.int64))
        self.register_buffer("scratch", torch.zeros(3), persistent=False)

    def forward(self, idx):
        return self.head(torch.tanh(self.fc(self.emb(idx)))).logsumexp(-1).mean()


class FakeParallel(GeneratedAttrs, nn.Module):
    """`Plain` as a one-rank 'parallelized' module: flat local names and a full map."""

    COMPUTE_CONFIG = {"plan_ngpus": 1, "runtime_ngpus": 1}
    GRAPH_FINGERPRINT = "fake"

    def __init__(self, seed: int = 0, dim: int = 4, vocab: int = 6, names=None):
        super().__init__()
        plain = Plain(seed, dim, vocab)
        names = names or {}
        self.fullmap, self.full_aliases = {}, {"head.weight": "emb_weight"}
        for local, full in (("emb_weight", "emb.weight"), ("fc_weight", "fc.weight"), ("fc_bias", "fc.bias")):
            value = plain.get_parameter(full)
            self.register_parameter(local, nn.Parameter(value.detach().clone()))
            self._map(local, names.get(full, full), value.shape)
        self.register_buffer("count", plain.count.clone())
        self._map("count", "count", ())
        self.register_buffer("scratch", plain.scratch.clone(), persistent=False)
        self._map("scratch", "scratch", (3,))

    def _map(self, local, full, shape):
        self.fullmap[local] = FullMapEntry(local, full, tuple(shape), tuple((0, d) for d in shape))

    def forward(self, idx):
        h = torch.tanh(torch.nn.functional.linear(self.emb_weight[idx], self.fc_weight, self.fc_bias))
        return torch.nn.functional.linear(h, self.emb_weight).logsumexp(-1).mean()


def trained(seed: int = 0, steps: int = 2, optimizer=torch.optim.Adam, **kw):
    """A FakeParallel and its optimizer after `steps` steps."""
    pm = FakeParallel(seed, **kw)
    opt = optimizer(pm.parameters(), lr=0.1)
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        opt.zero_grad()
        pm(torch.randint(0, 6, (5,), generator=g)).backward()
        opt.step()
    return pm, opt
