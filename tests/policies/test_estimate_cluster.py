"""Cluster descriptions (nnscaler.policies.estimate.cluster): the shipped ones load, and each bad
input is a ClusterError naming the file and the key."""
from __future__ import annotations

import pytest

from nnscaler.policies.estimate import SHIPPED, ClusterError, load_cluster, parse_cluster
from nnscaler.policies.estimate.local import local_cluster, resolve_cluster

GOOD = {"gpu": {"name": "H100-SXM-80GB", "bf16_tflops": 989, "memory_gb": 80, "memory_gbps": 3350},
        "gpus_per_node": 8, "intra_node": {"gbps": 450, "latency_us": 3}, "inter_node": {"gbps": 50, "latency_us": 10}}


def write(tmp_path, text):
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    return path


def test_shipped_descriptions_load():
    assert set(SHIPPED) == {"a100-80gb-sxm", "h100-sxm", "h200", "h800"}
    a100, h100, h200, h800 = (load_cluster(n) for n in ("a100-80gb-sxm", "h100-sxm", "h200", "h800"))
    assert (a100.gpu.bf16_tflops, a100.gpu.memory_gb, a100.gpus_per_node) == (312, 80, 8)
    assert h100.gpu.peak_flops == 989e12 and h100.intra_node.bytes_per_s == 450e9 and h100.inter_node.latency_s == pytest.approx(1e-5)
    assert h200.gpu.memory_gb == 141 and h200.gpu.memory_gbps == 4800
    # DeepSeek-V3's report: NVLink 160 GB/s, IB 50 GB/s a GPU; the H100's compute and memory
    assert (h800.gpu.peak_flops, h800.gpu.memory_gb, h800.gpu.sms) == (989e12, 80, 132)
    assert (h800.intra_node.gbps, h800.inter_node.gbps) == (160, 50)


def test_the_issue_example_parses(tmp_path):
    path = write(tmp_path, """
gpu: {name: H100-SXM-80GB, bf16_tflops: 989, memory_gb: 80, memory_gbps: 3350}
gpus_per_node: 8
intra_node: {gbps: 450, latency_us: 3}    # per GPU, one direction
inter_node: {gbps: 50, latency_us: 10}    # per GPU (400 Gb/s NIC each)
""")
    c = load_cluster(str(path))
    assert c.gpu.dtype_bytes == 2 and c.op_overhead_us == 5.0 and c.name == "cluster"


def test_a_known_gpu_by_name_alone():
    data = dict(GOOD, gpu={"name": "A100-SXM-80GB"})
    assert parse_cluster(data, "x.yaml").gpu.memory_gbps == 2039


@pytest.mark.parametrize("change, words", [
    (lambda d: d.pop("gpus_per_node"), ["x.yaml", "missing key 'gpus_per_node'"]),
    (lambda d: d["intra_node"].pop("gbps"), ["x.yaml", "'intra_node.gbps'"]),
    (lambda d: d.update(gpus_per_node="eight"), ["x.yaml", "'gpus_per_node' must be a whole number"]),
    (lambda d: d.update(gpus_per_node=8.5), ["'gpus_per_node' must be a whole number"]),
    (lambda d: d["gpu"].update(bf16_tflops="fast"), ["'gpu.bf16_tflops' must be a number > 0"]),
    (lambda d: d["inter_node"].update(latency_us=-1), ["'inter_node.latency_us' must be a number > 0"]),
    (lambda d: d.update(gpu={"name": "B300-NVL"}), ["x.yaml", "'gpu.name' 'B300-NVL' is not a known GPU",
                                                     "A100-SXM-80GB"]),
    (lambda d: d.update(gpu=["H100"]), ["'gpu' must be a mapping"]),
    (lambda d: d.update(gpus_pernode=8), ["unknown key(s) 'gpus_pernode'"]),
    (lambda d: d["gpu"].update(dtype="fp8"), ["'gpu.dtype' must be one of bf16, fp32"]),
    (lambda d: d.update(efficiency={"matmul": 1.5}), ["'efficiency.matmul' is a fraction of peak"]),
    (lambda d: d.update(efficiency={"gemm": 0.5}), ["unknown key(s) 'efficiency.gemm'"]),
])
def test_bad_values_name_the_file_and_key(change, words):
    data = {k: (dict(v) if isinstance(v, dict) else v) for k, v in GOOD.items()}
    change(data)
    with pytest.raises(ClusterError) as e:
        parse_cluster(data, "x.yaml")
    for w in words:
        assert w in str(e.value)


def test_bad_files(tmp_path):
    with pytest.raises(ClusterError, match="neither a shipped description .*a100-80gb-sxm.*local"):
        load_cluster("h900")
    with pytest.raises(ClusterError, match="is not valid YAML"):
        load_cluster(str(write(tmp_path, "gpu: {name: [")))
    with pytest.raises(ClusterError, match="a cluster description is a mapping"):
        load_cluster(str(write(tmp_path, "- 1\n- 2\n")))


COMM = {"backend": "given", "collectives": {"all_reduce": {"2": [2e-4, 1e9]}}}


@pytest.fixture
def keep_threads():
    import torch
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_local_is_measured_from_what_autodist_measures(keep_threads):
    c = local_cluster(comm=COMM, threads=1)
    assert c.gpu.dtype == "fp32" and c.gpu.bf16_tflops > 0 and c.gpu.memory_gbps > 0 and c.gpu.memory_gb > 0
    # the 2-rank all-reduce line (2e-4 s + wire / 1 GB/s) read back as a ring: two latency steps
    assert c.intra_node.latency_us == pytest.approx(100.0)
    assert c.intra_node.gbps == pytest.approx(1.0, rel=1e-6)
    assert c.efficiency == {"matmul": 1.0, "memory": 1.0} and c.op_overhead_us == 10.0
    assert resolve_cluster("h200").gpu.memory_gb == 141


@pytest.mark.multiprocess
def test_local_peak_is_measured_beside_the_other_ranks(keep_threads):
    import multiprocessing
    c = local_cluster(comm=COMM, ranks=2, threads=1)  # one peer process runs the same matmul meanwhile
    assert c.gpu.bf16_tflops > 0 and '"ranks": 2' in c.source and c.gpus_per_node >= 2
    assert not multiprocessing.active_children()  # the peer is gone
