"""bench/gpu.py: its smoke run (CPU, bf16) trains all four variants from the same weights on the
same batches (identical losses) and reports every figure; without CUDA and without ``--smoke`` it
refuses in one line (exit 2, no traceback, nothing written); the MFU parts (peak table, FLOPs
formula) hold what the docstring says. The figures themselves are the benchmark's business."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "bench")
VARIANTS = {"eager", "nnscaler_parallelize", "torch_compile", "nnscaler_train"}


def _load(name):
    saved = list(sys.path)
    sys.path.insert(0, BENCH)
    try:
        spec = importlib.util.spec_from_file_location(f"bench_{name}", os.path.join(BENCH, f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path[:] = saved
        sys.modules.pop(f"bench_{name}", None)


def _env(tmp_path, **extra):
    (tmp_path / "tmp").mkdir(exist_ok=True)
    return dict(os.environ, NNSCALER_CACHE_DIR=str(tmp_path / "cache"), XDG_CACHE_HOME=str(tmp_path / "xdg"),
                TMPDIR=str(tmp_path / "tmp"), PYTHONWARNINGS="ignore", **extra)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_gpu_bench_smoke_runs_every_variant_from_the_same_weights(tmp_path):
    out = tmp_path / "gpu.json"
    cmd = [sys.executable, os.path.join(BENCH, "gpu.py"), "--smoke", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env=_env(tmp_path, CUDA_VISIBLE_DEVICES=""))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    data = json.loads(out.read_text())
    assert data["errors"] == {} and set(data["variants"]) == VARIANTS
    assert data["config"]["dtype"] == "bf16" and data["variants"]["nnscaler_parallelize"]["param_dtypes"] == ["torch.bfloat16"]
    losses = {n: v["losses"] for n, v in data["variants"].items()}
    assert all(len(v) == data["config"]["warmup_steps"] + data["config"]["timed_steps"] for v in losses.values())
    # eager and both nnscaler variants run the same ops on the same weights and data
    for name in ("nnscaler_parallelize", "nnscaler_train"):
        assert losses[name] == pytest.approx(losses["eager"], abs=1e-3), (name, losses)
    for name, v in data["variants"].items():
        assert v["tokens_per_s"] > 0 and len(v["step_ms"]) == data["config"]["timed_steps"], name
        assert v["mfu"] is None and v["peak_memory_bytes"] is None, name  # CPU: no peak, no device memory
    assert set(data["ratio_vs_eager"]) == VARIANTS - {"eager"} and isinstance(data["target_met"], bool)
    assert data["device"]["mfu_reason"] and data["reference"]["source"].startswith("https://github.com/pytorch/torchtitan")
    assert data["flops_per_token"] > 6 * data["config"]["model"]["params_for_flops"]


@pytest.mark.multiprocess
def test_gpu_bench_without_cuda_refuses_in_one_line(tmp_path):
    out = tmp_path / "gpu.json"
    done = subprocess.run([sys.executable, os.path.join(BENCH, "gpu.py"), "--out", str(out)], capture_output=True,
                          text=True, timeout=300, cwd=ROOT, env=_env(tmp_path, CUDA_VISIBLE_DEVICES=""))
    assert done.returncode == 2, done.stderr
    assert "needs a CUDA device" in done.stderr and "--smoke" in done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not out.exists()


def test_peak_table_picks_the_specific_name_and_explains_unknown_devices():
    gpu = _load("gpu")
    assert gpu.peak_tflops("NVIDIA H100 80GB HBM3") == (989.0, None)
    assert gpu.peak_tflops("NVIDIA H100 PCIe") == (756.0, None)
    assert gpu.peak_tflops("NVIDIA H200") == (989.0, None)
    assert gpu.peak_tflops("NVIDIA A100-SXM4-80GB") == (312.0, None)
    peak, reason = gpu.peak_tflops("Some Future GPU")
    assert peak is None and "PEAK_BF16_TFLOPS" in reason
    peak, reason = gpu.peak_tflops(None)
    assert peak is None and "no CUDA device" in reason


def test_flops_per_token_is_6n_plus_attention_without_the_token_embedding():
    llama = _load("_llama")
    cfg = llama.LlamaConfig(vocab=100, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn=48, seq=16)
    model = llama.Llama(cfg)
    total, n = llama.param_counts(model)
    assert total - n == 100 * 32  # the token embedding only; the untied head counts
    assert llama.flops_per_token(model, 16) == 6 * n + 12 * 2 * 4 * 8 * 16
    tied = llama.Llama(llama.LlamaConfig(vocab=100, dim=32, n_layers=2, n_heads=4, ffn=48, seq=16, tie_embeddings=True))
    total, n = llama.param_counts(tied)
    assert total == n  # the shared matrix counted once, as the head
