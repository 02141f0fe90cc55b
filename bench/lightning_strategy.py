"""Step time of nnscaler's Lightning strategy (NnScalerStrategy, dp) against Lightning's own
DDPStrategy, same model, data and Trainer settings, in the same run.

    python bench/lightning_strategy.py [--steps 60] [--warmup 10] [--rounds 3] [--layers 6] [--hidden 512] [--batch 64]

2 gloo CPU processes (torch.multiprocessing.spawn; each rank gets max(1, cores // 2) intra-op
threads) run both strategies one after the other, alternating which goes first per round, so
slow drift of the machine hits both alike. Model: --layers Linear(--hidden, --hidden) with ReLU
and a Linear head of 8 classes, cross entropy, Adam(1e-3), fp32; random data, --batch samples
per rank per step. The step time is the median interval between consecutive
`on_train_batch_end` calls on rank 0 after --warmup steps; the ratio is nnscaler / DDP per round,
then the median of the rounds.

Writes bench/results/lightning_strategy.json (``--out``; ``--smoke``: the smallest run, results in
a temporary directory).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # no file in bench/ is named like an installed package (tests/bench checks)

from _common import median, parse_args, run_header, save_results, spawn_gloo, threads_per_rank  # noqa: E402

WORLD, CLASSES = 2, 8


def _module(args):
    import lightning.pytorch as pl
    import torch
    import torch.nn.functional as F

    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            layers = []
            for _ in range(args["layers"]):
                layers += [torch.nn.Linear(args["hidden"], args["hidden"]), torch.nn.ReLU()]
            self.net = torch.nn.Sequential(*layers, torch.nn.Linear(args["hidden"], CLASSES))

        @property
        def dummy_forward_args(self):
            return {"x": torch.zeros(args["batch"], args["hidden"])}

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self(x), y)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    return Net()


def _loader(args):
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    g = torch.Generator().manual_seed(1)
    n = args["batch"] * WORLD * (args["steps"] + args["warmup"] + 1)
    data = TensorDataset(torch.randn(n, args["hidden"], generator=g), torch.randint(0, CLASSES, (n,), generator=g))
    return DataLoader(data, batch_size=args["batch"], shuffle=False)


def _fit(kind, args, workdir):
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy

    class Timer(pl.Callback):
        def __init__(self):
            self.ends = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.ends.append(time.perf_counter())

    if kind == "ddp":
        strategy = DDPStrategy()
    else:
        from nnscaler.ir import ComputeConfig
        from nnscaler.lightning import NnScalerStrategy
        strategy = NnScalerStrategy(compute_config=ComputeConfig(1, WORLD), pas_policy="dp",
                                    gen_savedir=os.path.join(workdir, "gen"))
    timer = Timer()
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=WORLD, max_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=os.path.join(workdir, kind), callbacks=[timer], num_sanity_val_steps=0)
    trainer.fit(_module(args), _loader(args))
    steps = [b - a for a, b in zip(timer.ends, timer.ends[1:])][args["warmup"]:]
    return median(steps)


def worker(rank, args, workdir):
    out = {"ddp": [], "nnscaler": []}
    for r in range(args["rounds"]):
        for kind in (("ddp", "nnscaler") if r % 2 == 0 else ("nnscaler", "ddp")):
            out[kind].append(_fit(kind, args, workdir))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--out", default=os.path.join(HERE, "results", "lightning_strategy.json"))
    a = parse_args(p, {"steps": 2, "warmup": 1, "rounds": 1, "layers": 1, "hidden": 16, "batch": 4},
                   "lightning_strategy.json")
    args = dict(steps=a.steps, warmup=a.warmup, rounds=a.rounds, layers=a.layers, hidden=a.hidden, batch=a.batch)
    with tempfile.TemporaryDirectory() as tmp:
        runs, _ = spawn_gloo(worker, (args, tmp), WORLD, os.path.join(tmp, "result.json"), gather=False,
                             env={"PYTHONWARNINGS": "ignore"})
    ratios = [n / d for n, d in zip(runs["nnscaler"], runs["ddp"])]
    result = dict(run_header())
    result.update({
        "loadavg_at_end": list(os.getloadavg()),
        "config": {"nproc": WORLD, "threads_per_rank": threads_per_rank(WORLD), "backend": "gloo",
                   "model": f"{a.layers} x (Linear({a.hidden}, {a.hidden}) + ReLU) + Linear({a.hidden}, {CLASSES})",
                   "batch_per_rank": a.batch, "optimizer": "Adam(lr=1e-3)", "precision": "32-true",
                   "steps": a.steps, "warmup": a.warmup, "rounds": a.rounds,
                   "nnscaler": "NnScalerStrategy(compute_config=ComputeConfig(1, 2), pas_policy='dp')",
                   "reference": "lightning.pytorch.strategies.DDPStrategy()"},
        "step_ms": {k: round(median(v) * 1e3, 3) for k, v in runs.items()},
        "runs_step_ms": {k: [round(x * 1e3, 3) for x in v] for k, v in runs.items()},
        "ratio_nnscaler_vs_ddp": round(median(ratios), 4),
        "ratios_per_round": [round(r, 4) for r in ratios],
        "target": "<= 1.05",
    })
    save_results(a.out, result)
    print({k: result[k] for k in ("step_ms", "ratio_nnscaler_vs_ddp", "ratios_per_round")})


if __name__ == "__main__":
    main()
