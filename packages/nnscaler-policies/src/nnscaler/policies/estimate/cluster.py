"""A described cluster: the GPU's peak and memory, GPUs per node and the two links.

The YAML (docs/autodist.md, "Planning a cluster you do not have")::

    gpu: {name: H100-SXM-80GB, bf16_tflops: 989, memory_gb: 80, memory_gbps: 3350}
    gpus_per_node: 8
    intra_node: {gbps: 450, latency_us: 3}    # per GPU, one direction
    inter_node: {gbps: 50, latency_us: 10}    # per GPU (400 Gb/s NIC each)

``gpu`` may name a GPU of `KNOWN_GPUS` alone (``gpu: {name: A100-SXM-80GB}``): the missing numbers
come from that table. Optional: ``gpu.dtype`` (``bf16``, default, or ``fp32``: what the peak is
for and what training runs in) and ``efficiency`` (``matmul``, ``attention``, ``memory``: the
fractions of peak each op class reaches, defaults in `costs.EFFICIENCY`) and ``op_overhead_us``
(the fixed cost of one op: kernel launch and dispatch, default 5), ``gpu.sms`` (streaming
multiprocessors: the GEMM shape model's wave quantization, `costs.gemm_shape_efficiency`; known GPUs
have it, without it a GEMM's shape is not priced) and ``fused_attention`` (default
true; false: the software has no fused attention kernel, so attention runs as two batched matmuls
and a softmax over the materialised s x s scores, `costs.unfused_attention_time`). Calibrated from
one measured step: ``nnscaler plan estimate --calibrate-step-seconds`` (`calibrate`). Every bad
value is a `ClusterError` naming the file, the key and the fix.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Dict, Optional

import yaml

from nnscaler.ir import ConfigError

__all__ = ["ClusterError", "Cluster", "GPU", "Link", "KNOWN_GPUS", "SHIPPED", "load_cluster", "parse_cluster"]

CLUSTERS_DIR = Path(__file__).resolve().parent / "clusters"
SHIPPED = tuple(sorted(p.stem for p in CLUSTERS_DIR.glob("*.yaml")))  # plus "local" (measured here)

# Data-sheet numbers (dense bf16 tensor-core TFLOP/s, HBM GB and GB/s, streaming multiprocessors):
# NVIDIA A100 datasheet (SXM4 80GB) and A100 whitepaper (108 SMs), NVIDIA H100 datasheet (SXM5) and
# H100 whitepaper (132 SMs on SXM5), NVIDIA H200 datasheet (SXM; the H100's GH100 die, 132 SMs), the H800
# (SXM: the H100 SXM5 with a narrower NVLink; its compute and memory the H100's).
KNOWN_GPUS: Dict[str, dict] = {
    "A100-SXM-80GB": {"bf16_tflops": 312, "memory_gb": 80, "memory_gbps": 2039, "sms": 108},
    "A100-SXM-40GB": {"bf16_tflops": 312, "memory_gb": 40, "memory_gbps": 1555, "sms": 108},
    "H100-SXM-80GB": {"bf16_tflops": 989, "memory_gb": 80, "memory_gbps": 3350, "sms": 132},
    "H200-SXM-141GB": {"bf16_tflops": 989, "memory_gb": 141, "memory_gbps": 4800, "sms": 132},
    "H800-SXM-80GB": {"bf16_tflops": 989, "memory_gb": 80, "memory_gbps": 3350, "sms": 132},
}
_DTYPES = {"bf16": 2, "fp32": 4}


class ClusterError(ConfigError):
    """A cluster description that cannot be used; the message names the file, the key and the fix."""


@dataclasses.dataclass(frozen=True)
class GPU:
    name: str
    bf16_tflops: float  # the dense peak of `dtype`
    memory_gb: float
    memory_gbps: float
    dtype: str = "bf16"
    sms: Optional[int] = None  # streaming multiprocessors (GEMM wave quantization); None: shapes not priced

    @property
    def peak_flops(self) -> float:
        return self.bf16_tflops * 1e12

    @property
    def dtype_bytes(self) -> int:
        return _DTYPES[self.dtype]


@dataclasses.dataclass(frozen=True)
class Link:
    """Per GPU, one direction."""
    gbps: float  # GB/s
    latency_us: float

    @property
    def bytes_per_s(self) -> float:
        return self.gbps * 1e9

    @property
    def latency_s(self) -> float:
        return self.latency_us * 1e-6


@dataclasses.dataclass(frozen=True)
class Cluster:
    name: str
    gpu: GPU
    gpus_per_node: int
    intra_node: Link
    inter_node: Link
    efficiency: Dict[str, float] = dataclasses.field(default_factory=dict)  # overrides of costs.EFFICIENCY
    source: str = ""
    op_overhead_us: float = 5.0  # fixed cost of launching one op (kernel launch and dispatch)  # the file it came from, or how it was measured
    fused_attention: bool = True  # False: no flash attention kernel (the s x s scores materialised)

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        out.pop("source")
        return out


def _num(where: str, key: str, value, integer: bool = False):
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok or not value > 0:
        kind = "a whole number > 0" if integer else "a number > 0"
        raise ClusterError(f"{where}: '{key}' must be {kind}, got {value!r}; fix it in the cluster description")
    return value if integer else float(value)


def _mapping(where: str, key: str, value) -> dict:
    if not isinstance(value, dict):
        raise ClusterError(f"{where}: '{key}' must be a mapping (e.g. {{gbps: 450, latency_us: 3}}), got {value!r}")
    return value


def _only(where: str, key: str, value: dict, allowed) -> None:
    unknown = sorted(str(k) for k in value if k not in allowed)
    if unknown:
        raise ClusterError(f"{where}: unknown key(s) {', '.join(repr(f'{key}.{k}' if key else k) for k in unknown)}; "
                           f"{key or 'the description'} takes {', '.join(sorted(allowed))}")


def _gpu(where: str, raw) -> GPU:
    raw = _mapping(where, "gpu", raw)
    _only(where, "gpu", raw, ("name", "bf16_tflops", "memory_gb", "memory_gbps", "dtype", "sms"))
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise ClusterError(f"{where}: 'gpu.name' is missing or not a string; name the GPU (e.g. H100-SXM-80GB)")
    numbers = ("bf16_tflops", "memory_gb", "memory_gbps")
    missing = [k for k in numbers if k not in raw]
    base = {}
    if missing:
        if name not in KNOWN_GPUS:
            raise ClusterError(f"{where}: 'gpu.name' {name!r} is not a known GPU and 'gpu' lacks "
                               f"{', '.join('gpu.' + k for k in missing)}; give those numbers, or name one of "
                               f"{', '.join(sorted(KNOWN_GPUS))}")
        base = KNOWN_GPUS[name]
    vals = {k: _num(where, f"gpu.{k}", raw.get(k, base.get(k))) for k in numbers}
    dtype = raw.get("dtype", "bf16")
    if dtype not in _DTYPES:
        raise ClusterError(f"{where}: 'gpu.dtype' must be one of {', '.join(_DTYPES)}, got {dtype!r}")
    sms = raw.get("sms", KNOWN_GPUS.get(name, {}).get("sms"))
    sms = None if sms is None else _num(where, "gpu.sms", sms, integer=True)
    return GPU(name, dtype=dtype, sms=sms, **vals)


def _link(where: str, key: str, raw) -> Link:
    raw = _mapping(where, key, raw)
    _only(where, key, raw, ("gbps", "latency_us"))
    for k in ("gbps", "latency_us"):
        if k not in raw:
            raise ClusterError(f"{where}: missing key '{key}.{k}'; give {key}: {{gbps: ..., latency_us: ...}}")
    return Link(_num(where, f"{key}.gbps", raw["gbps"]), _num(where, f"{key}.latency_us", raw["latency_us"]))


def parse_cluster(data, where: str, name: Optional[str] = None) -> Cluster:
    """A `Cluster` from the parsed YAML `data`; `where` names it in errors (the file)."""
    if not isinstance(data, dict):
        raise ClusterError(f"{where}: a cluster description is a mapping with keys gpu, gpus_per_node, intra_node "
                           f"and inter_node, got {type(data).__name__}")
    _only(where, "", data, ("gpu", "gpus_per_node", "intra_node", "inter_node", "efficiency", "op_overhead_us",
                            "fused_attention", "name"))
    for key in ("gpu", "gpus_per_node", "intra_node", "inter_node"):
        if key not in data:
            raise ClusterError(f"{where}: missing key '{key}'; a cluster description needs gpu, gpus_per_node, "
                               f"intra_node and inter_node (see docs/autodist.md)")
    eff = _mapping(where, "efficiency", data.get("efficiency", {}))
    _only(where, "efficiency", eff, ("matmul", "attention", "memory"))
    eff = {k: _num(where, f"efficiency.{k}", v) for k, v in eff.items()}
    for k, v in eff.items():
        if v > 1:
            raise ClusterError(f"{where}: 'efficiency.{k}' is a fraction of peak, at most 1; got {v}")
    fused = data.get("fused_attention", True)
    if not isinstance(fused, bool):
        raise ClusterError(f"{where}: 'fused_attention' must be true or false (false: attention without a fused "
                           f"kernel, the s x s scores materialised), got {fused!r}")
    return Cluster(str(data.get("name") or name or Path(where).stem), _gpu(where, data["gpu"]),
                   _num(where, "gpus_per_node", data["gpus_per_node"], integer=True),
                   _link(where, "intra_node", data["intra_node"]), _link(where, "inter_node", data["inter_node"]),
                   eff, where, _num(where, "op_overhead_us", data.get("op_overhead_us", 5.0)), fused)


def load_cluster(spec: str) -> Cluster:
    """A shipped description by name (`SHIPPED`) or the path of a YAML file (``local``, this machine
    measured: `local.resolve_cluster`)."""
    path = Path(spec)
    if spec in SHIPPED:
        path = CLUSTERS_DIR / f"{spec}.yaml"
    elif not path.is_file():
        raise ClusterError(f"cluster {spec!r} is neither a shipped description ({', '.join(SHIPPED)}, local) nor "
                           f"an existing YAML file; give one of those names or the path of your description")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ClusterError(f"cannot read the cluster description {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ClusterError(f"{path} is not valid YAML ({str(e).splitlines()[0]}); fix the file") from None
    return parse_cluster(data, str(path), path.stem)
