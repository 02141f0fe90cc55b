"""The training loop on one process (no process group): parity with a hand-written loop, hooks,
reductions, clipping, the LR scheduler, compile mode, parallel_modules."""
from __future__ import annotations

import pytest
import torch

from loop_helpers import config, hand_loop, run_trainer
from parity import assemble_full


def weights(pieces):
    return assemble_full([(0, pieces)], "trainer")


def test_one_process_equals_hand_written_loop(tmp_path):
    losses, pieces, _ = run_trainer(config(tmp_path))
    ref_losses, ref = hand_loop()
    assert len(losses) == 6
    assert losses == pytest.approx(ref_losses, abs=1e-6)
    got = weights(pieces)
    assert set(got) == set(ref)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], atol=1e-6, rtol=0)


def test_hooks_fire_in_order_and_count(tmp_path):
    data = config(tmp_path, max_train_steps=..., max_epochs=2,
                  **{"dataset.val_args": {"size": 8, "seed": 1}})
    _, _, calls = run_trainer(data)
    count = {n: calls.count(n) for n in set(calls)}
    steps, epochs, val_batches = 8, 2, 2 * 2  # 4 steps per epoch; 8 val samples / micro-batch 4, per val run
    for name in ("on_step_start", "on_step_end", "on_train_step_start", "on_train_step_end", "before_zero_grad",
                 "after_zero_grad", "before_sync_grad", "after_sync_grad", "before_gnorm_clip", "after_gnorm_clip",
                 "before_optimizer_step", "after_optimizer_step", "before_log_train_metrics",
                 "after_aggregate_train_step_outputs"):
        assert count[name] == steps, name
    assert count["on_epoch_start"] == count["on_epoch_end"] == epochs
    assert count["on_val_start"] == count["on_val_end"] == count["before_log_val_metrics"] == epochs
    assert count["on_val_step_start"] == count["on_val_step_end"] == val_batches
    assert count["after_setup"] == count["on_train_start"] == count["on_train_end"] == count["on_finalize"] == 1
    first = calls[calls.index("on_step_start"):calls.index("on_step_end") + 1]
    assert first == ["on_step_start", "before_zero_grad", "after_zero_grad", "on_train_step_start",
                     "before_sync_grad", "after_sync_grad", "on_train_step_end", "after_aggregate_train_step_outputs",
                     "before_gnorm_clip", "after_gnorm_clip", "before_optimizer_step", "after_optimizer_step",
                     "before_log_train_metrics", "on_step_end"]
    assert calls[0] == "after_setup" and calls[1] == "on_train_start" and calls[-1] == "on_finalize"


def test_loss_reduction_sum_is_twice_mean(tmp_path):
    mean, _, _ = run_trainer(config(tmp_path / "a", max_train_steps=2))
    total, _, _ = run_trainer(config(tmp_path / "b", max_train_steps=2, **{"optimizer.loss_reduction": "sum"}))
    assert total[0] == pytest.approx(2 * mean[0], rel=1e-6)


def test_grad_reduction_sum_and_clip(tmp_path):
    base, p0, _ = run_trainer(config(tmp_path / "a", max_train_steps=1, **{"optimizer.type": "torch.optim.SGD",
                                                                            "optimizer.args": {"lr": 0.1}}))
    summed, p1, _ = run_trainer(config(tmp_path / "b", max_train_steps=1, **{
        "optimizer.type": "torch.optim.SGD", "optimizer.args": {"lr": 0.1}, "optimizer.grad_reduction": "sum"}))
    init, _ = hand_loop(steps=0)
    torch.manual_seed(0)
    from trainer_models import MLP
    w0 = dict(MLP(16, 2).named_parameters())
    a, b = weights(p0), weights(p1)
    for name in a:  # SGD: the update with summed gradients is twice the one with averaged ones
        torch.testing.assert_close(b[name] - w0[name].detach(), 2 * (a[name] - w0[name].detach()), atol=1e-6, rtol=1e-5)
    clipped, p2, _ = run_trainer(config(tmp_path / "c", max_train_steps=1, **{
        "optimizer.type": "torch.optim.SGD", "optimizer.args": {"lr": 0.1}, "optimizer.clip_gnorm": 1e-3}))
    c = weights(p2)
    step = torch.cat([(c[n] - w0[n].detach()).flatten() for n in c]).norm()
    assert step.item() == pytest.approx(0.1 * 1e-3, rel=1e-3)  # |lr * clipped grad| = lr * max_norm


def test_per_token_mean(tmp_path):
    data = config(tmp_path, max_train_steps=2, **{"model.type": "trainer_models.SumLossMLP",
                                                   "optimizer.grad_reduction": "per-token-mean",
                                                   "optimizer.aggregate_outputs_fn": "trainer_models.count_token_outputs"})
    losses, pieces, _ = run_trainer(data)
    # same gradients as the mean-squared-error MLP: sum over tokens / number of tokens
    ref_losses, ref_pieces, _ = run_trainer(config(tmp_path / "ref", max_train_steps=2))
    a, b = weights(pieces), weights(ref_pieces)
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=1e-5)


def test_lr_scheduler_step_interval(tmp_path):
    data = config(tmp_path, max_train_steps=3, **{"lr_scheduler": {"type": "torch.optim.lr_scheduler.StepLR",
                                                                   "args": {"step_size": 1, "gamma": 0.5},
                                                                   "interval": "step"},
                                                  "hook": {"before_log_train_metrics": "loop_helpers.record_lr"}})
    import loop_helpers
    loop_helpers.LRS.clear()
    run_trainer(data)
    assert loop_helpers.LRS == pytest.approx([0.01, 0.005, 0.0025])


def test_compile_mode_generates_code_only(tmp_path):
    from nnscaler.trainer import Trainer, TrainerArgs
    data = config(tmp_path, run_mode="compile", broadcast_strategy="none")
    Trainer(train_args=TrainerArgs.from_dict(data)).run()
    assert list((tmp_path / "gen").rglob("gencode0.py"))


def test_parallel_modules(tmp_path):
    data = config(tmp_path, max_train_steps=2, **{
        "model.type": "trainer_models.Outer", "model.args": {"dim": 16},
        "model.parallel_modules": [{"type": "trainer_models.Inner", "args": {"dim": 16},
                                    "forward_args_gen_fn": "trainer_models.mlp_forward_args"}]})
    losses, pieces, _ = run_trainer(data)
    assert len(losses) == 2 and all(l == l for l in losses)
    assert any(name.startswith("a.") for name, *_ in pieces)


def test_init_env_fn_replaces_seed_and_epoch_scheduler(tmp_path):
    import loop_helpers
    loop_helpers.INIT_CALLS.clear()
    loop_helpers.LRS.clear()
    loop_helpers.LOSSES.clear()
    data = config(tmp_path, seed=..., init_env_fn="loop_helpers.init_env", max_train_steps=..., max_epochs=2, **{
        "lr_scheduler": {"type": "torch.optim.lr_scheduler.StepLR", "args": {"step_size": 1, "gamma": 0.1}},
        "hook": {"before_log_train_metrics": "loop_helpers.record_lr"}})
    losses, pieces, _ = run_trainer(data)
    assert loop_helpers.INIT_CALLS == [0]
    assert loop_helpers.LRS == pytest.approx([0.01] * 4 + [0.001] * 4)  # interval 'epoch' (the default)
    ref_losses, _ = hand_loop(steps=4)
    assert loop_helpers.LOSSES[:4] == pytest.approx(ref_losses, abs=1e-6)  # same initial weights as seed 0


@pytest.mark.parametrize("precision, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16),
                                              ({"param": "fp32", "buffer": "fp32", "input": "fp32"}, torch.float32)])
def test_precision(tmp_path, precision, dtype):
    from nnscaler.trainer import Trainer, TrainerArgs
    trainer = Trainer(train_args=TrainerArgs.from_dict(config(tmp_path, precision=precision, max_train_steps=2,
                                                              hook=...)))
    trainer.run()
    params = list(trainer.model.parameters())
    assert {p.dtype for p in params} == {dtype}
    assert trainer.state.step == 2 and trainer.state.last_train_loss == trainer.state.last_train_loss  # not NaN
    assert (trainer.precision.scaler is not None) == (dtype == torch.float16)


def test_async_save_is_committed_at_the_end_at_a_preemption_and_on_a_failure(tmp_path, monkeypatch, capsys):
    """checkpoint.async_save on a stand-in backend (no background process): the writer is prepared
    at set-up, once the optimizer exists; the run waits for each save before the next, commits the
    last one before it ends (or stops on SIGTERM, before saying so), and a failing run still moves
    last to the save that committed."""
    import os
    from test_checkpoint_manager import FakeAsyncCkpt
    from nnscaler.trainer import Trainer
    from nnscaler.trainer.checkpoints import layout
    from nnscaler.trainer.preemption import PreemptionWatch
    fake = FakeAsyncCkpt()
    monkeypatch.setattr(layout, "BACKEND", fake)

    def run(name, steps=4):
        fake.log.clear()
        run_trainer(config(tmp_path / name, max_train_steps=steps, **{
            "checkpoint.no_save": False, "checkpoint.every_n_train_steps": 2, "checkpoint.async_save": True}))

    run("end")
    assert fake.log == [("prepare", "NnScalerAdamW"), ("async_save", "0000-0002"), ("wait", "0000-0002"), ("async_save", "0000-0004"),
                        ("wait", "0000-0004")]
    assert os.readlink(tmp_path / "end" / "ckpt" / "last") == "0000-0004"

    calls = []
    monkeypatch.setattr(PreemptionWatch, "requested", lambda self: calls.append(1) or len(calls) == 3)
    capsys.readouterr()
    run("term", steps=6)  # SIGTERM seen after step 3
    assert fake.log == [("prepare", "NnScalerAdamW"), ("async_save", "0000-0002"), ("wait", "0000-0002"), ("async_save", "0000-0003"),
                        ("wait", "0000-0003")]
    assert os.readlink(tmp_path / "term" / "ckpt" / "last") == "0000-0003"
    assert "preempted: stopped at step 3" in capsys.readouterr().out
    monkeypatch.undo()
    monkeypatch.setattr(layout, "BACKEND", fake)

    log_step = Trainer._log_step

    def failing(self, *args):
        if self.state.step == 3:
            raise RuntimeError("boom at step 3")
        return log_step(self, *args)
    monkeypatch.setattr(Trainer, "_log_step", failing)
    with pytest.raises(RuntimeError, match="boom at step 3"):
        run("fail")
    assert fake.log == [("prepare", "NnScalerAdamW"), ("async_save", "0000-0002"), ("wait", "0000-0002")]
    assert os.readlink(tmp_path / "fail" / "ckpt" / "last") == "0000-0002"


def test_a_model_that_cannot_validate_is_refused_before_the_first_step(tmp_path):
    """A forward traced in training mode that branches on self.training cannot run validation: the
    Trainer refuses it at set-up (no step trained, so none lost), naming the branch and the fixes;
    without validation it trains."""
    from nnscaler.trainer import TrainerConfigError
    from trainer_models import RecordingHook
    data = config(tmp_path / "a", max_train_steps=2, **{"model.type": "trainer_models.TrainOnlyNoiseMLP",
                                                        "dataset.val_args": {"size": 8, "seed": 1}})
    RecordingHook.losses.clear()
    with pytest.raises(TrainerConfigError, match=r"dataset.val_args: the run validates, but .* traced in training "
                                                 r"mode and runs other ops in eval mode.*remove dataset.val_args"):
        run_trainer(data)
    assert RecordingHook.losses == []
    losses, _, _ = run_trainer(config(tmp_path / "b", max_train_steps=2,
                                      **{"model.type": "trainer_models.TrainOnlyNoiseMLP"}))
    assert len(losses) == 2
