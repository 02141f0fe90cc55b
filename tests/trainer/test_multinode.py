"""Two "nodes" on this machine (two torchrun commands, one process each, separate gen_savedirs) train
like one process: with broadcast_strategy code (node 1 gets the code from rank 0), and with none
(the code generated beforehand by `nnscaler compile` and copied to node 1, as a user would)."""
from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import yaml

from launch import free_port
from loop_helpers import config, run_trainer
from test_cli import env, nnscaler
from test_example import losses

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize("strategy", ["code", "none"])
def test_two_nodes_same_losses_as_one_process(tmp_path, strategy):
    ref, _, _ = run_trainer(config(tmp_path / "ref", max_train_steps=4))
    data = config(tmp_path, hook=..., max_train_steps=4, broadcast_strategy=strategy,
                  **{"compute_config.runtime_ngpus": 2})
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(data))
    if strategy == "none":  # compile once (no torchrun needed), ship the code to both "nodes"
        r = nnscaler("compile", "-f", str(cfg), "--gen_savedir", str(tmp_path / "gen0"), cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        shutil.copytree(tmp_path / "gen0", tmp_path / "gen1")
    port = free_port()
    procs = []
    for node in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node}",
               "--nproc_per_node=1", "--master_addr=127.0.0.1", f"--master_port={port}",
               "-m", "nnscaler.trainer", "-f", str(cfg), "--gen_savedir", str(tmp_path / f"gen{node}")]
        procs.append(subprocess.Popen(cmd, cwd=tmp_path, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, out[-2000:] + err[-3000:]
    assert losses(outs[0][0]) == pytest.approx(ref, abs=6e-5)  # printed with 4 decimals
    assert list((tmp_path / "gen1").rglob("gencode1.py"))  # node 1 ran its own rank's code
