"""``nnscaler info``."""
from importlib import metadata

import torch
from typer.testing import CliRunner

from nnscaler.cli.info import devices, distributed_backends, nnscaler_distributions
from nnscaler.cli.main import app

runner = CliRunner()


def test_distributions_include_umbrella_and_parts():
    rows = nnscaler_distributions()
    names = [name for name, _, _ in rows]
    assert names[0] == "nnscaler"
    for part in ("nnscaler-ir", "nnscaler-runtime", "nnscaler-cli"):
        assert part in names
    assert len(names) == len(set(names))
    versions = dict((name, version) for name, version, _ in rows)
    assert versions["nnscaler-cli"] == metadata.version("nnscaler-cli")


def test_distributed_backends_match_torch():
    backends = distributed_backends(torch)
    assert set(backends) == {"gloo", "nccl", "mpi"}
    assert backends["gloo"] == torch.distributed.is_gloo_available()
    assert backends["nccl"] == torch.distributed.is_nccl_available()


def test_devices_list_cpu_then_cuda():
    rows = devices(torch)
    assert rows[0][0] == "cpu"
    cuda = [name for name, _ in rows if name.startswith("cuda:")]
    assert len(cuda) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)


def test_info_command_prints_tables():
    result = runner.invoke(app, ["info"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    out = result.output
    assert "nnscaler-cli" in out and metadata.version("nnscaler-cli") in out
    assert torch.__version__ in out
    assert "gloo" in out and "nccl" in out and "mpi" in out
    assert "cpu" in out
