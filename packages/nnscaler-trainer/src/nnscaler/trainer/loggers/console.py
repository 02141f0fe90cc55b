"""What a person sees on rank 0: a rich progress bar and one line per logged step."""
from __future__ import annotations

import sys
from typing import Optional

__all__ = ["ConsoleReporter", "format_train_line", "format_val_line"]


def format_train_line(m, total_steps: Optional[int]) -> str:
    """``epoch 0 step 3/20 | loss 2.3456 | lr 1.00e-03 | gnorm 0.812 | 812.3 samples/s | ...``; a
    mixture-of-experts model adds ``aux_loss 2.0154 | expert_imbalance 1.32`` after the loss, and with a
    capacity factor ``dropped_tokens 12 (1.2%)`` (the (token, slot) pairs over capacity)."""
    parts = [f"epoch {m.epoch} step {m.step}{f'/{total_steps}' if total_steps else ''}", f"loss {m.train_loss:.4f}"]
    moe = getattr(m, "moe", None)
    if moe is not None and moe.aux_loss is not None:
        parts.append(f"aux_loss {moe.aux_loss:.4f}")
    if moe is not None and moe.expert_imbalance is not None:
        parts.append(f"expert_imbalance {moe.expert_imbalance:.2f}")
    if moe is not None and moe.dropped_tokens is not None:  # a capacity factor is set
        parts.append(f"dropped_tokens {moe.dropped_tokens:.0f} ({100 * (moe.dropped_fraction or 0.0):.1f}%)")
    parts.append(f"lr {m.lr:.2e}")
    if m.gnorm is not None:
        parts.append(f"gnorm {m.gnorm:.3f}")
    if m.samples_per_s is not None:
        parts.append(f"{m.samples_per_s:.1f} samples/s")
    if m.tokens_per_s is not None:
        parts.append(f"{m.tokens_per_s:.0f} tokens/s")
    if m.step_time_s is not None:
        parts.append(f"{m.step_time_s * 1000:.1f} ms/step")
    if m.memory_mb is not None:
        parts.append(f"mem {m.memory_mb:.0f} MB")
    return " | ".join(parts)


def format_val_line(m) -> str:
    return f"epoch {m.epoch} step {m.step} | val_loss {m.val_loss:.4f} ({m.num_batches} batches)"


class ConsoleReporter:
    """Rank 0's console: a progress bar over the training steps (``enable_progress_bar``) with
    the step lines printed above it, or plain lines."""

    def __init__(self, enabled: bool, progress_bar: bool, total_steps: Optional[int], stream=None):
        self.enabled = enabled
        self.total_steps = total_steps
        self._progress = None
        self._task = None
        self._stream = stream or sys.stdout
        if not enabled:
            return
        from rich.console import Console
        self.console = Console(file=self._stream, highlight=False, soft_wrap=True)
        if progress_bar:
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                       TimeRemainingColumn)
            self._progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                      TextColumn("{task.fields[status]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                                      console=self.console, transient=False)
            self._progress.start()
            self._task = self._progress.add_task("train", total=total_steps, status="")

    def line(self, text: str) -> None:
        if not self.enabled:
            return
        if self._progress is not None:  # printed above the live bar
            self.console.print(text, markup=False)
        else:
            self._stream.write(text + "\n")
            self._stream.flush()

    def train_step(self, metrics, completed: int) -> None:
        if not self.enabled:
            return
        self.line(format_train_line(metrics, self.total_steps))
        if self._progress is not None:
            self._progress.update(self._task, completed=completed, status=f"loss {metrics.train_loss:.4f}")

    def set_completed(self, completed: int) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=completed)

    def val(self, metrics) -> None:
        self.line(format_val_line(metrics))

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
