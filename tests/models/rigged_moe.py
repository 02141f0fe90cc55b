"""A tiny mixture-of-experts language model whose router can be rigged by the data, for the
expert-parallel routing tests (tests/models/test_moe_routing.py).

Each token id belongs to a class (``id // 8``) whose row of the `ROUTES` table is added to the
router's logits: 0 (the router decides), a mask (-1e4) on every expert but the allowed ones, or a
bonus (+30) on one expert. A batch made of one class's ids therefore sends every token where the
case says (all to rank 0's experts, all to one expert, to the first and last ranks only...), with
the same weights and one compiled plan for every case. `train(rank, world, plans, gen_root)` trains
each plan through every case (one Adam step per case) and returns what the parent compares with
`reference` (one process, float64).
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

VOCAB, SEQ, HIDDEN, FFN, EXPERTS, K, LAYERS = 64, 8, 16, 8, 8, 2, 2
GLOBAL_BATCH, NMICROS, LR = 4, 2, 1e-2
MASK, BONUS = -1e4, 30.0

# token class -> (experts allowed, expert favoured); None: every expert, no favourite
ROUTES = {0: (None, None),
          1: ((0, 1), None),   # rank 0's experts (under ep 2 and ep 4)
          2: ((6, 7), None),   # the last rank's experts
          3: (None, 5),        # every token's first choice is expert 5
          4: ((0, 7), None),   # the first and last ranks' experts: the middle ranks of ep 4 get nothing
          5: ((3,), None)}     # one expert only (the second choice has weight ~0)

# (label, how its token ids are drawn): one Adam step per case, in this order
CASES = [("random", "class 0"), ("all-to-rank-0", "class 1"), ("all-to-one-expert", "class 3"),
         ("first-and-last-ranks", "class 4"), ("all-to-last-rank", "class 2"), ("one-expert-only", "class 5"),
         ("single-token-away", "class 1, one token class 2"), ("crossed", "first half class 2, second class 1"),
         ("random-classes", "each token a random class"), ("random-again", "class 0")]


def route_table() -> torch.Tensor:
    table = torch.zeros(VOCAB, EXPERTS, dtype=torch.float64)
    for cls, (allowed, favoured) in ROUTES.items():
        rows = slice(8 * cls, 8 * cls + 8)
        if allowed is not None:
            table[rows] = MASK
            table[rows, list(allowed)] = 0.0
        if favoured is not None:
            table[rows, favoured] = BONUS
    return table


class RiggedBlock(torch.nn.Module):
    """Softmax top-k routing (logits + the rig) to experts with a gated SiLU MLP, a residual; with
    `capacity` (a capacity factor) the experts drop what is over it."""

    def __init__(self, capacity=None):
        super().__init__()
        self.capacity = capacity
        self.router = torch.nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.gate_up = torch.nn.Parameter(torch.randn(EXPERTS, 2 * FFN, HIDDEN) * 0.3)
        self.down = torch.nn.Parameter(torch.randn(EXPERTS, HIDDEN, FFN) * 0.3)

    def forward(self, x, rig):
        import nnscaler
        b, s, h = x.shape
        flat = x.reshape(b * s, h)
        probs = (self.router(flat) + rig.reshape(b * s, EXPERTS)).softmax(-1)
        weights, index = probs.topk(K, dim=-1)
        y = nnscaler.routed_experts(flat, index, weights, self.gate_up, self.down, activation="silu",
                                    capacity_factor=self.capacity)
        return x + y.reshape(b, s, h)


class RiggedMoE(torch.nn.Module):
    def __init__(self, capacity=None):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.blocks = torch.nn.ModuleList(RiggedBlock(capacity) for _ in range(LAYERS))
        self.head = torch.nn.Linear(HIDDEN, VOCAB)
        self.register_buffer("route", route_table())

    def forward(self, input_ids, labels):
        x = self.embed(input_ids)
        rig = F.embedding(input_ids, self.route)
        for block in self.blocks:
            x = block(x, rig)
        logits = self.head(x)
        return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def make(capacity=None) -> RiggedMoE:
    torch.manual_seed(0)
    return RiggedMoE(capacity).to(torch.float64)


def batch(step: int, n: int = GLOBAL_BATCH) -> dict:
    """Case `step`'s batch of `n` samples (the same in every process)."""
    g = torch.Generator().manual_seed(500 + step)
    how = CASES[step][1]
    cls = torch.zeros(n, SEQ, dtype=torch.long)
    if how.startswith("class "):
        cls[:] = int(how.split()[1].rstrip(","))
        if "one token" in how:
            cls[n - 1, SEQ - 1] = 2
    elif how.startswith("first half"):
        cls[: n // 2], cls[n // 2:] = 2, 1
    else:
        cls = torch.randint(0, len(ROUTES), (n, SEQ), generator=g)
    ids = 8 * cls + torch.randint(0, 8, (n, SEQ), generator=g)
    return {"input_ids": ids, "labels": torch.randint(0, VOCAB, (n, SEQ), generator=g)}


def _micro(b, n):
    size = len(b["input_ids"]) // n
    return [{k: v[i * size:(i + 1) * size] for k, v in b.items()} for i in range(n)]


def reference(halves: bool = False, capacity=None):
    """One process, Adam, one step per case on the global batch ((losses, parameters)); with
    `halves` each step accumulates the two halves of the batch (each loss / 2)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = make(capacity)
        opt = torch.optim.Adam(model.parameters(), lr=LR)
        losses = []
        for step in range(len(CASES)):
            opt.zero_grad()
            parts = _micro(batch(step), 2) if halves else [batch(step)]
            loss = 0.0
            for part in parts:
                value = model(**part) / len(parts)
                value.backward()
                loss += float(value.detach())
            opt.step()
            losses.append(loss)
        return losses, {k: v.detach().clone() for k, v in model.named_parameters()}
    finally:
        torch.set_num_threads(threads)


def train(rank, world, plans, gen_root):
    """Every plan ((label, plan_ngpus, ComputeConfig keywords, policy ``ep`` unless the keywords
    name one under "policy", dropless unless they give a capacity factor under "capacity")) through
    every case: by label,
    (losses, this rank's parameter shards, collective calls by kind per step, the expert-load record
    after each step as {layer: counts})."""
    return {label: _train_plan(rank, world, label, plan_ngpus, cfg, gen_root) for label, plan_ngpus, cfg in plans}


def _train_plan(rank, world, label, plan_ngpus, cfg_kw, gen_root):
    import torch.distributed as dist
    from nnscaler import ComputeConfig, build_optimizer, parallelize
    from nnscaler.runtime import comm, moe

    cfg_kw = dict(cfg_kw)
    policy, capacity = cfg_kw.pop("policy", "ep"), cfg_kw.pop("capacity", None)
    cfg = ComputeConfig(plan_ngpus, world, trace_strategy="cpu", **cfg_kw)
    dp_size, dp_rank = world // plan_ngpus, rank // plan_ngpus
    per = GLOBAL_BATCH // dp_size
    end2end = cfg.use_end2end
    sample = {k: v[:per // NMICROS if end2end else per] for k, v in batch(0).items()}
    pm = parallelize(make(capacity), sample, policy, cfg, gen_savedir=os.path.join(gen_root, label),
                     instance_name=f"rigged_{label}".replace("-", "_"))
    opt = build_optimizer(pm, torch.optim.Adam, lr=LR)
    losses, calls, loads = [], [], []
    for step in range(len(CASES)):
        mine = {k: v[dp_rank * per:(dp_rank + 1) * per] for k, v in batch(step).items()}
        opt.zero_grad()
        with comm.count_collectives() as stats:
            if end2end:
                outputs = pm.train_step(_micro(mine, NMICROS))
                opt.scale_grads(1.0 / NMICROS)
                loss = torch.stack([o.detach().reshape(()) for o in outputs]).mean() if outputs else torch.zeros(())
            else:
                loss = pm(**mine)
                loss.backward()
            opt.step()
        calls.append({name: entry["calls"] for name, entry in stats.snapshot().items()})
        loads.append({layer: c.tolist() for layer, c in moe.expert_load().per_layer.items()})
        t = loss.detach().reshape(1).clone().to(torch.float64)
        dist.all_reduce(t)
        losses.append(t.item() / world)
    if cfg.zero_stage == 3:
        from model_plans import _merged_weights
        return losses, _merged_weights(pm, opt, os.path.join(gen_root, label, "ckpt")), calls, loads
    with pm.unsharded():
        shards = [(e.full_name, e.full_shape, e.slices, getattr(pm, local).detach().clone())
                  for local, e in pm.fullmap.items() if isinstance(getattr(pm, local), torch.nn.Parameter)]
    return losses, shards, calls, loads
