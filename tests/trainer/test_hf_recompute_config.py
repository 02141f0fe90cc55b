"""Activation recomputation from the Trainer's config (issue 43 §1): examples/trainer/hf_llama.yaml
with `compute_config.pas_config.recompute_modules: LlamaDecoderLayer` written in the YAML file, a tiny
Llama in float64 under dp 2, trains exactly as the same run without it (one launch runs both): the
same weights after 2 steps (within 1e-10) and the same loss; the recomputed run's generated code
checkpoints both decoder layers on every rank, the other none."""
from __future__ import annotations

import glob
import os

import pytest
import torch
import yaml

from hf_runs import EXAMPLE, overrides, write_configs
from launch import run_workers
from parity import assemble_full

pytestmark = pytest.mark.multiprocess
pytest.importorskip("transformers")


def _worker(rank, world, runs):
    """Each (yaml, argv) run in turn: (the loss of the parallel model on the first 4 blocks, this
    rank's weight pieces)."""
    from nnscaler.trainer import Trainer, TrainerArgs
    from trainer_models import full_weights
    out = {}
    for label, (path, argv) in runs.items():
        trainer = Trainer(train_args=TrainerArgs.from_yaml(path, argv))
        trainer.run()
        trainer.model.eval()
        [loss] = trainer.model.infer_step([({"input_ids": trainer.train_dataset.blocks[:4]},)])
        out[label] = (float(loss), full_weights(trainer.model))
    return out


def test_recompute_modules_in_the_yaml_trains_like_without(tmp_path):
    configs = write_configs(tmp_path / "configs")
    text = tmp_path / "text.txt"
    text.write_text(open(os.path.join(os.path.dirname(EXAMPLE), "..", "..", "docs", "trainer.md")).read()[:3000])
    with open(EXAMPLE) as f:
        cfg = yaml.safe_load(f)
    cfg["compute_config"]["pas_config"] = {"recompute_modules": "LlamaDecoderLayer"}
    recompute_yaml = tmp_path / "hf_llama_recompute.yaml"
    recompute_yaml.write_text(yaml.safe_dump(cfg))
    runs = {label: (path, overrides(str(tmp_path / label), configs["llama"], "dp2", str(text))
                    + ["--model.args.dtype", "float64", "--dataset.train_args.cache_dir", str(tmp_path / "datasets")])
            for label, path in (("plain", EXAMPLE), ("recompute", str(recompute_yaml)))}
    results = run_workers(_worker, 2, runs, timeout=400)
    (loss, _), (loss_rc, _) = results[0]["plain"], results[0]["recompute"]
    assert abs(loss_rc - loss) <= 1e-10 * abs(loss), (loss_rc, loss)
    plain = assemble_full(((r, res["plain"][1]) for r, res in enumerate(results)), "plain")
    recomputed = assemble_full(((r, res["recompute"][1]) for r, res in enumerate(results)), "recompute")
    assert plain.keys() == recomputed.keys() and all(v.dtype == torch.float64 for v in plain.values())
    for name, value in plain.items():
        assert (recomputed[name] - value).abs().max().item() <= 1e-10, name
    for label, calls in (("plain", 0), ("recompute", 2)):
        code = [open(p).read() for p in glob.glob(str(tmp_path / label / "gen" / "**" / "gencode*.py"), recursive=True)]
        assert len(code) == 2 and all(c.count("torch.utils.checkpoint.checkpoint(") == calls for c in code), label
