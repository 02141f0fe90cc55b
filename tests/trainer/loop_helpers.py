"""Configs and runners shared by the loop tests (importable by spawned workers)."""
from __future__ import annotations

import copy

import torch


def config(tmp, **over):
    """A small MLP run: 32 samples, global batch 8, AdamW; `over` sets dotted keys."""
    data = {
        "compute_config": {"plan_ngpus": 1, "runtime_ngpus": 1, "use_end2end": True, "trace_strategy": "cpu"},
        "pas_policy": "dp", "seed": 0, "gen_savedir": f"{tmp}/gen", "instance_name": "t",
        "micro_batch_size": 4, "global_batch_size": 8, "max_train_steps": 6, "enable_progress_bar": False,
        "model": {"type": "trainer_models.MLP", "args": {"dim": 16, "nlayers": 2}},
        "optimizer": {"type": "torch.optim.AdamW", "args": {"lr": 0.01}},
        "dataset": {"type": "trainer_models.RandomDataset", "train_args": {"size": 32}},
        "dataset_sampler": {"train_args": {"shuffle": True, "seed": 3}},
        "checkpoint": {"no_save": True, "save_dir": f"{tmp}/ckpt"},
        "hook": {"type": "trainer_models.RecordingHook"},
    }
    return set_dotted(copy.deepcopy(data), over)


def set_dotted(data, over):
    """`data` with each dotted key of `over` set (``...`` removes it); returns `data`."""
    for key, value in over.items():
        node = data
        *parents, last = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        if value is ...:
            node.pop(last, None)
        else:
            node[last] = value
    return data


def run_trainer(data):
    """Run the Trainer on `data`; returns (losses, weight pieces, hook calls)."""
    from nnscaler.trainer import Trainer, TrainerArgs
    from trainer_models import RecordingHook, full_weights
    trainer = Trainer(train_args=TrainerArgs.from_dict(data))
    trainer.run()
    return list(RecordingHook.losses), full_weights(trainer.model), list(RecordingHook.calls)


def worker(rank, world, data):
    return run_trainer(data)


def async_worker(rank, world, data):
    """`worker` with checkpoint.async_save, also returning this rank's background writer as every
    async_save found it and left it: [((running, pid, buffers made) before, (pid, buffers made)
    after)]; stops the writer at the end."""
    import nnscaler.ckpt as ckpt
    from nnscaler.ckpt.inflight import OWNER
    real, seen = ckpt.async_save, []

    def recording(*args, **kwargs):
        bg = OWNER.background
        before = (bg.running(), bg.proc.pid if bg.proc is not None else None, bg.buffers_made)
        handle = real(*args, **kwargs)
        seen.append((before, (bg.proc.pid, bg.buffers_made)))
        return handle
    ckpt.async_save = recording
    try:
        return run_trainer(data), seen
    finally:
        ckpt.async_save = real
        ckpt.stop_async_saves()


def resume_worker(rank, world, data, resume_at):
    """`data` straight (saving a checkpoint every `resume_at` steps), then, in the same processes, a
    second run resumed from the checkpoint of step `resume_at` (into another save_dir) to the same
    end; returns (the straight run's result, the resumed run's), each as `run_trainer`'s."""
    import os
    straight = run_trainer(set_dotted(copy.deepcopy(data), {"checkpoint.no_save": False,
                                                            "checkpoint.every_n_train_steps": resume_at}))
    save_dir = data["checkpoint"]["save_dir"]
    step_dir = next(n for n in sorted(os.listdir(save_dir)) if n.endswith(f"-{resume_at:04d}"))
    resumed = run_trainer(set_dotted(copy.deepcopy(data), {"checkpoint.no_save": False,
                                                           "checkpoint.save_dir": save_dir + "-resumed",
                                                           "checkpoint.resume_from": os.path.join(save_dir, step_dir)}))
    return straight, resumed


def hand_loop(steps=6, mbs=4, gas=2, lr=0.01, sampler_seed=3, size=32):
    """The same run written by hand on one process: the seed's data order, mean over micro-batches."""
    from trainer_models import MLP, RandomDataset
    torch.manual_seed(0)
    model = MLP(16, 2)
    ds = RandomDataset(size=size)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sampler = torch.utils.data.DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=sampler_seed)
    loader = torch.utils.data.DataLoader(ds, batch_size=mbs, sampler=sampler)
    losses, epoch = [], 0
    while len(losses) < steps:
        sampler.set_epoch(epoch)
        batches = list(loader)
        for i in range(0, len(batches) - gas + 1, gas):
            if len(losses) == steps:
                break
            opt.zero_grad()
            total = 0.0
            for b in batches[i:i + gas]:
                loss = model(b) / gas
                loss.backward()
                total += loss.item()
            opt.step()
            losses.append(total)
        epoch += 1
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


LRS: list = []
LOSSES: list = []


def record_lr(trainer, step_metrics, aggregated_outputs):
    """before_log_train_metrics hook of the LR tests."""
    LRS.append(step_metrics.lr)
    LOSSES.append(step_metrics.train_loss)


INIT_CALLS: list = []


def init_env(trainer):
    """init_env_fn of the init_env test: seeds the run itself."""
    INIT_CALLS.append(trainer.rank)
    torch.manual_seed(0)
