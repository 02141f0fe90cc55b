"""Trainer hook of bench/gpu.py's `nnscaler train` variant (not part of nnscaler): the end time of
every optimizer step (after a device synchronize), each step's loss and the step time the Trainer
logged (`TrainStepMetrics.step_time_s`), and the peak CUDA memory
allocated from the start of training (setup and tracing excluded), written as JSON at the end."""
from __future__ import annotations

import json
import time

import torch


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class StepTimer:
    def __init__(self, out: str):
        self.out, self.ends, self.losses, self.logged = out, [], [], []

    def on_train_start(self, trainer):
        _sync()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        self.start = time.perf_counter()

    def on_step_end(self, trainer, epoch, idx, step_metrics, aggregated_outputs):
        _sync()
        self.ends.append(time.perf_counter())
        self.losses.append(float(step_metrics.train_loss))
        self.logged.append(step_metrics.step_time_s)

    def on_train_end(self, trainer):
        if trainer.rank != 0:
            return
        peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
        with open(self.out, "w") as f:
            json.dump({"start": self.start, "ends": self.ends, "losses": self.losses, "logged_step_s": self.logged,
                       "peak_memory_bytes": peak}, f)
