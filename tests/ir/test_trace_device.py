"""Trace strategies: where traced functions run (cpu, meta, cuda, cuda_run_cpu_offload,
reuse_cache), the CPU fallback without CUDA, the reuse cache and the OOM retry."""
import os
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from nnscaler.ir import trace
from nnscaler.ir.tracer import trace_device
from nnscaler.ir.tracer.trace_device import ExecutionDevice

torch.manual_seed(0)
HAS_CUDA = torch.cuda.is_available()
GPU_STRATEGIES = ["cuda", "cuda_run_cpu_offload", "reuse_cache"]
no_cuda_only = pytest.mark.skipif(HAS_CUDA, reason="checks the fallback taken when no CUDA device is present")


class DeviceSpy(nn.Module):
    """Notes the device of its input, of an intermediate and of a parameter as seen in forward."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(4, 8), nn.Linear(8, 4)
        self.norm = nn.LayerNorm(4)
        self.seen = {}

    def forward(self, x):
        h = F.gelu(self.l1(x))
        self.seen = {"input": x.device, "hidden": h.device, "is_meta": h.is_meta}
        return self.norm(self.l2(h)) + x


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.fc = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.Linear(64, 10)

    def forward(self, img):
        return self.fc(torch.flatten(F.max_pool2d(F.relu(self.bn(self.conv(img))), 2), 1))


class Twins(nn.Module):
    """Two identical Linear layers on same-shaped inputs: the reuse cache answers the second."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.b(self.a(x))


MODELS = [(DeviceSpy, {"x": torch.randn(2, 4)}), (CNN, {"img": torch.randn(2, 3, 8, 8)}),
          (Twins, {"x": torch.randn(3, 4)})]


def quiet_trace(*args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return trace(*args, **kwargs)


@pytest.fixture
def devices(monkeypatch):
    """Every ExecutionDevice trace() creates."""
    made = []
    original = ExecutionDevice.for_strategy.__func__

    def spy(cls, strategy):
        made.append(original(cls, strategy))
        return made[-1]
    monkeypatch.setattr(ExecutionDevice, "for_strategy", classmethod(spy))
    return made


@pytest.fixture
def real_calls(monkeypatch):
    """The functions ExecutionDevice actually ran (cache hits do not run)."""
    calls = []
    original = trace_device._call

    def counting(func, args, kwargs, mode_off):
        calls.append(getattr(func, "__name__", str(func)))
        return original(func, args, kwargs, mode_off)
    monkeypatch.setattr(trace_device, "_call", counting)
    return calls


# ----------------------------------------------------------------------------- cpu and meta
@pytest.mark.parametrize("cls,args", MODELS)
def test_meta_gives_the_cpu_graph(cls, args):
    cpu = trace(cls(), args, trace_strategy="cpu")
    meta = trace(cls(), args, trace_strategy="meta")
    assert meta.fingerprint() == cpu.fingerprint()
    assert meta.summary() == cpu.summary()


def test_meta_runs_what_reads_weights_on_meta_and_keeps_weights():
    m = DeviceSpy()
    weight = m.l1.weight.detach().clone()
    trace(m, {"x": torch.randn(2, 4)}, trace_strategy="meta")
    # the example batch keeps its values (a copy); what reads a weight runs on meta
    assert m.seen == {"input": torch.device("cpu"), "hidden": torch.device("meta"), "is_meta": True}
    assert m.l1.weight.device.type == "cpu" and torch.equal(m.l1.weight, weight)
    trace(m, {"x": torch.randn(2, 4)}, trace_strategy="cpu")
    assert m.seen == {"input": torch.device("cpu"), "hidden": torch.device("cpu"), "is_meta": False}


def test_meta_keeps_captured_constant_values():
    class Const(nn.Module):
        def __init__(self):
            super().__init__()
            self.table = torch.tensor([1.0, 2.0])

        def forward(self, x):
            return x * self.table

    g = trace(Const(), {"x": torch.randn(2)}, trace_strategy="meta")
    assert torch.equal(g.constants["_constant_0"].tensor, torch.tensor([1.0, 2.0]))


def test_unknown_strategy():
    with pytest.raises(ValueError, match="unknown trace_strategy 'tpu'.*cuda_run_cpu_offload"):
        trace(Twins(), {"x": torch.randn(3, 4)}, trace_strategy="tpu")


# ----------------------------------------------------------------------------- GPU strategies without CUDA
@no_cuda_only
@pytest.mark.parametrize("strategy", GPU_STRATEGIES)
@pytest.mark.parametrize("cls,args", MODELS)
def test_gpu_strategies_fall_back_to_cpu_with_a_warning(strategy, cls, args):
    m = cls()
    with pytest.warns(UserWarning) as record:
        g = trace(m, args, trace_strategy=strategy)
    msgs = [str(w.message) for w in record if "trace_strategy" in str(w.message)]
    assert len(msgs) == 1  # once per trace
    assert f"trace_strategy {strategy!r} needs a CUDA device" in msgs[0]
    assert "runs on the CPU" in msgs[0]
    assert ("reuse cache" in msgs[0]) == (strategy == "reuse_cache")
    warned = next(w for w in record if "trace_strategy" in str(w.message))
    assert os.path.realpath(warned.filename) == os.path.realpath(__file__)  # points at the caller
    assert g.fingerprint() == trace(cls(), args, trace_strategy="cpu").fingerprint()
    if isinstance(m, DeviceSpy):
        assert m.seen["hidden"] == torch.device("cpu")


@no_cuda_only
@pytest.mark.parametrize("strategy,cache,offload", [("cuda", False, False), ("cuda_run_cpu_offload", False, False),
                                                    ("reuse_cache", True, False)])
def test_fallback_device_settings(strategy, cache, offload):
    with pytest.warns(UserWarning):
        d = ExecutionDevice.for_strategy(strategy)
    assert d.device == torch.device("cpu")
    assert (d.cache is not None) == cache and d.offload_on_oom == offload


# ----------------------------------------------------------------------------- the reuse cache
def test_reuse_cache_answers_repeated_calls(devices, real_calls):
    # x needs a gradient like a(x) does (the trace runs with grad on): same input metadata
    g = quiet_trace(Twins(), {"x": torch.randn(3, 4, requires_grad=True)}, trace_strategy="reuse_cache",
                    both_modes=False)
    assert len(devices[-1].cache) == 1  # both F.linear calls have the same signature
    assert real_calls.count("linear") == 1
    assert [n.module_path for n in g.nodes] == ["a", "b"]
    assert g.nodes[1].args[0] == g.nodes[0].outputs and g.nodes[1].outputs != g.nodes[0].outputs
    real_calls.clear()
    trace(Twins(), {"x": torch.randn(3, 4)}, trace_strategy="cpu", both_modes=False)
    assert devices[-1].cache is None and real_calls.count("linear") == 2


def test_reuse_cache_misses_on_different_metadata(devices, real_calls):
    class Widen(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            return self.a(x), self.b(x[:2]), self.b(x.t().contiguous())

    quiet_trace(Widen(), {"x": torch.randn(4, 4)}, trace_strategy="reuse_cache", both_modes=False)
    assert real_calls.count("linear") == 2  # (4, 4) twice, (2, 4) once
    assert len([k for k in devices[-1].cache if k[0] == id(F.linear)]) == 2


def test_reuse_cache_distinguishes_int_and_float_constants():
    class Mixed(nn.Module):
        def forward(self, x):
            return x * 2, x * 2.0, x * True

    cpu = trace(Mixed(), {"x": torch.arange(3)})
    cached = quiet_trace(Mixed(), {"x": torch.arange(3)}, trace_strategy="reuse_cache")
    assert [cached.value(r).dtype for r in cached.output] == ["int64", "float32", "int64"]
    assert cached.fingerprint() == cpu.fingerprint()


def test_reuse_cache_runs_inplace_ops_every_time(devices):
    class TwoUpdates(nn.Module):
        def forward(self, x):
            a = x.clone()
            a.add_(1)
            b = x.clone()
            b.add_(1)
            F.relu(b, inplace=True)
            return a, b

    cpu = trace(TwoUpdates(), {"x": torch.randn(2, 3)})
    cached = quiet_trace(TwoUpdates(), {"x": torch.randn(2, 3)}, trace_strategy="reuse_cache")
    assert cached.fingerprint() == cpu.fingerprint()
    assert cached.output[1] == cached.nodes[-1].outputs  # b is the value after its own updates
    assert not any(k[0] in (id(torch.Tensor.add_), id(F.relu)) for k in devices[-1].cache)


def test_cached_results_are_fresh_tensors():
    d = ExecutionDevice("cpu", cache=True)
    x = torch.randn(2, 3)
    first = d.run(torch.Tensor.sum, (x,), {"dim": 0})
    second = d.run(torch.Tensor.sum, (torch.randn(2, 3),), {"dim": 0})
    assert second is not first and torch.equal(second, first)  # a copy of the cached value
    third = d.run(torch.Tensor.sum, (x,), {"dim": 1})
    assert third.shape == (2,) and len(d.cache) == 2


# ----------------------------------------------------------------------------- OOM retry and twins
def _oom_once(calls):
    def fn(x):
        calls.append(x.device)
        if len(calls) == 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return x + 1
    return fn


def test_oom_retries_on_cpu_when_offloading():
    calls = []
    d = ExecutionDevice("cpu", offload_on_oom=True)
    out = d.run(_oom_once(calls), (torch.zeros(2),), {})
    assert torch.equal(out, torch.ones(2)) and d.fallbacks == 1 and len(calls) == 2
    assert calls[1] == torch.device("cpu")


def test_oom_propagates_without_offload():
    d = ExecutionDevice("cpu")
    with pytest.raises(torch.cuda.OutOfMemoryError):
        d.run(_oom_once([]), (torch.zeros(2),), {})
    assert d.fallbacks == 0


def test_twins_are_copied_once():
    d = ExecutionDevice("meta")
    w = nn.Parameter(torch.randn(3))
    t = d.twin(w)
    assert t.device.type == "meta" and t.requires_grad and d.twin(w) is t
    cpu = torch.randn(2)
    assert ExecutionDevice("cpu").twin(cpu) is cpu


# ----------------------------------------------------------------------------- on a real GPU
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("strategy", GPU_STRATEGIES)
def test_gpu_strategies_run_on_cuda(strategy):
    m = DeviceSpy()
    weight = m.l1.weight.detach().clone()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        g = trace(m, {"x": torch.randn(2, 4)}, trace_strategy=strategy)
    assert not [w for w in record if "needs a CUDA device" in str(w.message)]  # no CPU fallback
    assert m.seen["input"].type == "cuda" and m.seen["hidden"].type == "cuda"
    assert m.l1.weight.device.type == "cpu" and torch.equal(m.l1.weight, weight)  # weights stay put
    assert g.fingerprint() == trace(DeviceSpy(), {"x": torch.randn(2, 4)}, trace_strategy="cpu").fingerprint()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_gpu_reuse_cache_hits(devices, real_calls):
    trace(Twins(), {"x": torch.randn(3, 4)}, trace_strategy="reuse_cache")
    d = devices[-1]
    assert d.device.type == "cuda" and d.offload_on_oom and len(d.cache) == 1
    assert real_calls.count("linear") == 1


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_gpu_trace_restores_cuda_rng_and_buffers():
    class Noisy(CNN):
        def forward(self, img):
            return F.dropout(super().forward(img), 0.5, training=True)  # draws from the CUDA RNG

    m = Noisy().train()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    cuda_rng = torch.cuda.get_rng_state_all()
    g = trace(m, {"img": torch.randn(2, 3, 8, 8)}, trace_strategy="cuda")
    assert g.nodes[-1].target == "torch.nn.functional.dropout"
    assert all(torch.equal(a, b) for a, b in zip(cuda_rng, torch.cuda.get_rng_state_all()))
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())


# ----------------------------------------------------------------------------- meta-built modules
class MaskedMLP(nn.Module):
    """Reads the example batch's mask in Python (as transformers' mask checks do) before the weights."""

    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(4, 4)
        self.register_buffer("scale", torch.full((4,), 2.0), persistent=False)

    def forward(self, x, mask):
        if (mask == 0).any():  # a guard on the input: needs its value
            x = x * mask[..., None]
        keep = int(mask.sum().item())  # another value read of the batch
        return (self.l1(x) * self.scale[:1])[:keep].sum()


def test_meta_built_module_traces_value_reads_of_the_example_batch():
    args = {"x": torch.randn(3, 4), "mask": torch.tensor([1.0, 0.0, 1.0])}
    cpu = trace(MaskedMLP(), args, trace_strategy="cpu")
    with torch.device("meta"):
        m = MaskedMLP()
    meta = trace(m, args, trace_strategy="meta")
    assert meta.summary() == cpu.summary()
    assert [n.target for n in meta.nodes] == [n.target for n in cpu.nodes]
    assert all(t.is_meta for t in m.parameters())  # the module is left on meta


def test_meta_keeps_the_users_example_batch_unchanged():
    class InPlace(nn.Module):
        def __init__(self):
            super().__init__()
            self.l1 = nn.Linear(4, 4)

        def forward(self, x):
            x.mul_(2)  # on the trace's copy of the batch
            return self.l1(x).sum()

    x = torch.ones(2, 4)
    with torch.device("meta"):
        m = InPlace()
    trace(m, {"x": x}, trace_strategy="meta")
    assert torch.equal(x, torch.ones(2, 4))


def test_meta_value_read_of_a_weight_result_is_refused_with_the_fix():
    class ReadsWeights(nn.Module):
        def __init__(self):
            super().__init__()
            self.l1 = nn.Linear(4, 4)

        def forward(self, x):
            y = self.l1(x)
            if (y > 0).any():  # a value of the weights: nothing to read on meta
                y = y * 2
            return y.sum()

    with torch.device("meta"):
        m = ReadsWeights()
    from nnscaler.ir.errors import TraceError
    with pytest.raises(TraceError, match=r"reads the value of a tensor computed from the weights \(__bool__\).*"
                                         r"torch.where.*trace_strategy='cpu'"):
        trace(m, {"x": torch.randn(2, 4)}, trace_strategy="meta")
