"""Steps/s of the nnscaler Trainer against a plain torch DDP loop and Lightning's DDP strategy.

    python bench/trainer.py [--steps 40] [--warmup 5] [--rounds 3] [--out FILE] [--smoke]

Same model, data and batch for all three, 2 gloo CPU processes each (started by
torch.distributed.run; every rank gets max(1, cores // 2) intra-op threads): the character GPT of
examples/trainer/gpt_char.py (2 layers, n_embd 64, block 32) on docs/architecture.md, micro-batch
8, 2 accumulation steps (global batch 32), AdamW(lr 3e-3), gradient clipping at 1.0, fp32.

* ``nnscaler``  : `Trainer` (policy dp, ComputeConfig(1, 2)), config as examples/trainer/gpt_char.yaml
* ``ddp``       : DistributedDataParallel, DistributedSampler, `no_sync` on the first micro-batch,
                  clip_grad_norm_, the step loss all-reduced (the Trainer reports it too)
* ``lightning`` : lightning.Trainer(strategy="ddp", accumulate_grad_batches=2, gradient_clip_val=1)

Each variant runs --warmup + --steps optimizer steps; the time from the end of the warm-up step to
the end of the last step on rank 0 gives steps/s. Variants alternate for --rounds rounds (the
median is reported) so slow drift of the machine hits all alike. The nnscaler run also times one
checkpoint save (sharded, through nnscaler.ckpt) after training, reported as a share of a step.

Writes bench/results/trainer.json (``--out``; ``--smoke``: the smallest run, results in a temporary
directory).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
EXAMPLE = os.path.join(ROOT, "examples", "trainer")
MBS, GAS, NPROC, LR, CLIP = 8, 2, 2, 3e-3, 1.0


# -- workers (run under torch.distributed.run) ----------------------------------------------------
class StepTimer:
    """Hook of the nnscaler run: step-end times, and one timed checkpoint save at the end."""

    def __init__(self, out: str, warmup: int):
        self.out, self.warmup, self.ends = out, warmup, []

    def on_step_end(self, trainer, epoch, idx, step_metrics, aggregated_outputs):
        self.ends.append(time.perf_counter())

    def on_train_end(self, trainer):
        start = time.perf_counter()
        trainer.save_checkpoint()
        save_s = time.perf_counter() - start
        if trainer.rank == 0:
            _write(self.out, self.ends, self.warmup, save_s=save_s)


def _write(out, ends, warmup, **extra):
    timed = ends[warmup:]
    data = {"steps": len(timed) - 1, "seconds": timed[-1] - timed[0], **extra}
    data["steps_per_s"] = data["steps"] / data["seconds"]
    with open(out, "w") as f:
        json.dump(data, f)


def _data(rank):
    import torch
    sys.path.insert(0, EXAMPLE)
    from gpt_char import CharCorpus, CharGPT
    torch.manual_seed(0)
    model = CharGPT()
    ds = CharCorpus("train")
    sampler = torch.utils.data.DistributedSampler(ds, num_replicas=NPROC, rank=rank, shuffle=True, seed=0)
    return model, ds, sampler


def run_nnscaler(out, steps, warmup, workdir):
    sys.path.insert(0, EXAMPLE)
    from nnscaler.trainer import Trainer, TrainerArgs
    args = TrainerArgs.from_yaml(os.path.join(EXAMPLE, "gpt_char.yaml"), [
        f"--vars.run_dir={workdir}/nnscaler", "--gen_reuse=moo", f"--max_train_steps={warmup + steps + 1}", "--val_every_n_train_steps!",
        "--dataset.val_args!", "--checkpoint.every_n_train_steps!", "--log!", "--enable_progress_bar=false",
        "--lr_scheduler!", "--hook.type=__main__.StepTimer", f"--hook.args.out={out}", f"--hook.args.warmup={warmup}"])
    Trainer(train_args=args).run()


def run_ddp(out, steps, warmup, workdir):
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, ds, sampler = _data(rank)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=LR, weight_decay=0.01)
    loader = torch.utils.data.DataLoader(ds, batch_size=MBS, sampler=sampler, drop_last=True)
    ends, epoch = [], 0
    while len(ends) < warmup + steps + 1:
        sampler.set_epoch(epoch)
        batches = []
        for batch in loader:
            batches.append(batch)
            if len(batches) < GAS:
                continue
            opt.zero_grad()
            total = torch.zeros(())
            for i, b in enumerate(batches):
                ctx = ddp.no_sync() if i < GAS - 1 else torch.enable_grad()
                with ctx:
                    loss = ddp(b) / GAS
                    loss.backward()
                total += loss.detach()
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), CLIP)
            opt.step()
            dist.all_reduce(total)
            ends.append(time.perf_counter())
            batches = []
            if len(ends) == warmup + steps + 1:
                break
        epoch += 1
    if rank == 0:
        _write(out, ends, warmup)
    del ddp  # its reducer holds the group: release it before the group goes
    dist.barrier()
    dist.destroy_process_group()


def run_lightning(out, steps, warmup, workdir):
    import lightning as L
    import torch
    sys.path.insert(0, EXAMPLE)
    from gpt_char import CharCorpus, CharGPT

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.model = CharGPT()

        def training_step(self, batch, batch_idx):
            return self.model(batch)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.01)

    class Timer(L.Callback):
        def __init__(self):
            self.ends = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if (batch_idx + 1) % GAS == 0:
                self.ends.append(time.perf_counter())

    timer = Timer()
    loader = torch.utils.data.DataLoader(CharCorpus("train"), batch_size=MBS, shuffle=True, drop_last=True)
    trainer = L.Trainer(accelerator="cpu", devices=NPROC, strategy="ddp", max_steps=warmup + steps + 1,
                        accumulate_grad_batches=GAS, gradient_clip_val=CLIP, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=f"{workdir}/lightning",
                        callbacks=[timer])
    trainer.fit(Module(), loader)
    if trainer.global_rank == 0:
        _write(out, timer.ends, warmup)


WORKERS = {"nnscaler": run_nnscaler, "ddp": run_ddp, "lightning": run_lightning}


# -- driver ---------------------------------------------------------------------------------------
def launch(variant, steps, warmup, tmp, round_):
    workdir = os.path.join(tmp, f"{variant}-{round_}")  # fresh per run: checkpoints, generated code
    os.makedirs(workdir)
    out = os.path.join(workdir, f"{variant}.json")
    threads = max(1, (os.cpu_count() or 1) // NPROC)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={NPROC}",
           os.path.abspath(__file__), "--worker", variant, "--worker-out", out, "--steps", str(steps),
           "--warmup", str(warmup), "--workdir", workdir]
    for _ in range(2):  # a gloo teardown can abort a finished run (seen once with DDP): run it again
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=workdir)
        if proc.returncode == 0:
            break
    if proc.returncode != 0:
        raise SystemExit(f"{variant} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    with open(out) as f:
        return json.load(f)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--worker", choices=sorted(WORKERS))
    p.add_argument("--worker-out", help="(internal) a worker's result file")
    p.add_argument("--workdir")
    p.add_argument("--out", default=os.path.join(HERE, "results", "trainer.json"))
    if "--worker" in sys.argv:
        a = p.parse_args()
        import torch
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // NPROC))
        WORKERS[a.worker](a.worker_out, a.steps, a.warmup, a.workdir)
        return
    sys.path.insert(0, HERE)
    from _common import command_line, machine_info, median, parse_args, save_results, timestamp
    a = parse_args(p, {"steps": 2, "warmup": 1, "rounds": 1}, "trainer.json")
    runs = {v: [] for v in WORKERS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            for variant in (list(WORKERS) if r % 2 == 0 else list(WORKERS)[::-1]):
                res = launch(variant, a.steps, a.warmup, tmp, r)
                runs[variant].append(res)
                print(f"round {r} {variant:9s} {res['steps_per_s']:.2f} steps/s", flush=True)
    sps = {v: median([x["steps_per_s"] for x in rs]) for v, rs in runs.items()}
    save_s = median([x["save_s"] for x in runs["nnscaler"]])
    result = {
        "timestamp": timestamp(), "command": command_line(), "machine": machine_info(),
        "loadavg_at_end": os.getloadavg(),
        "config": {"nproc": NPROC, "threads_per_rank": max(1, (os.cpu_count() or 1) // NPROC), "backend": "gloo",
                   "model": "examples/trainer/gpt_char.py CharGPT(n_layer=2, n_head=4, n_embd=64, block_size=32)",
                   "micro_batch_size": MBS, "grad_accumulation_steps": GAS, "global_batch_size": MBS * GAS * NPROC,
                   "optimizer": f"AdamW(lr={LR}, weight_decay=0.01)", "clip_gnorm": CLIP, "steps": a.steps,
                   "warmup": a.warmup, "rounds": a.rounds},
        "steps_per_s": sps,
        "runs": runs,
        "ratios": {"nnscaler_vs_lightning": sps["nnscaler"] / sps["lightning"],
                   "nnscaler_vs_ddp": sps["nnscaler"] / sps["ddp"]},
        # the same ratios per round (the three variants ran back to back), then their median:
        # less sensitive to other load on the machine drifting between rounds
        "paired_ratios": {f"nnscaler_vs_{ref}": median([n["steps_per_s"] / o["steps_per_s"]
                                                        for n, o in zip(runs["nnscaler"], runs[ref])])
                          for ref in ("lightning", "ddp")},
        "targets": {"nnscaler_vs_lightning": ">= 1.0", "nnscaler_vs_ddp": ">= 0.97"},
        "checkpoint_save_s": save_s,
        "checkpoint_save_share_of_step": save_s * sps["nnscaler"],
    }
    save_results(a.out, result)
    print(json.dumps({k: result[k] for k in ("steps_per_s", "ratios", "paired_ratios", "checkpoint_save_s",
                                             "checkpoint_save_share_of_step")}, indent=1))


if __name__ == "__main__":
    main()
