import importlib.util
import sys
import types

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from launch import run_workers
from nnscaler.runtime.errors import GenerationError, NnScalerError, PlanMismatchError
from nnscaler.ir.contracts import FullMapEntry
from nnscaler.runtime.module import ParallelModule, make_compute_config
from nnscaler.runtime.optimizer import build_optimizer
from nnscaler.runtime.reducer import sync_grad_when


DIM, NLAYERS, GLOBAL_BATCH, LR, STEPS = 8, 3, 8, 1e-2, 5


# -- the single-device model and its hand-written "generated" counterpart -------------------------

class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(DIM, DIM) for _ in range(NLAYERS))

    def forward(self, x, y):
        for layer in self.layers:
            x = F.gelu(layer(x))
        return F.mse_loss(x.sum(-1), y)


class GenMLP(ParallelModule):
    """MLP written the way generated code is: flat local names, add_full_map, _forward_impl."""

    COMPUTE_CONFIG = {"plan_ngpus": 1, "runtime_ngpus": 1}
    REPLICAS = 1

    def __init__(self, init_params=False):
        super().__init__()
        for i in range(NLAYERS):
            for kind, shape in (("weight", (DIM, DIM)), ("bias", (DIM,))):
                local = f"layers_{i}_{kind}"
                self.register_parameter(local, torch.nn.Parameter(torch.empty(shape)))
                self.add_full_map(local, f"layers.{i}.{kind}", full_shape=shape,
                                  slices=tuple((0, d) for d in shape), value_split=(0, 1), replicas=self.REPLICAS)
        self._post_init(init_params)

    def _forward_impl(self, x, y):
        for i in range(NLAYERS):
            x = F.gelu(F.linear(x, getattr(self, f"layers_{i}_weight"), getattr(self, f"layers_{i}_bias")))
        return F.mse_loss(x.sum(-1), y)


def gen_class(base=GenMLP, **config):
    return type(base.__name__, (base,), {"COMPUTE_CONFIG": {"plan_ngpus": 1, "runtime_ngpus": 1, **config}})


def batch(step, n=GLOBAL_BATCH):
    g = torch.Generator().manual_seed(step)
    return {"x": torch.randn(n, DIM, generator=g), "y": torch.randn(n, generator=g)}


def local_name(full):
    return full.replace(".", "_")


def reference(steps=STEPS, clip=None):
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    losses, norms = [], []
    for s in range(steps):
        loss = model(**batch(s))
        opt.zero_grad()
        loss.backward()
        if s == 0:  # Adam hides a wrong gradient scale: compare the first gradients too
            first_grads = {local_name(n): p.grad.clone() for n, p in model.named_parameters()}
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        opt.step()
        losses.append(loss.item())
    return losses, {local_name(n): p.detach() for n, p in model.named_parameters()}, norms, first_grads


def initial_state():
    torch.manual_seed(0)
    return MLP().state_dict()


def assert_parity(got_losses, got_params, got_grads, ref):
    ref_losses, ref_params, _, ref_grads = ref
    for name, g in got_grads.items():
        assert torch.allclose(g, ref_grads[name], atol=1e-6, rtol=1e-5), name
    for a, b in zip(got_losses, ref_losses):
        assert abs(a - b) <= 1e-5 * max(abs(b), 1e-8), (got_losses, ref_losses)
    for name, p in got_params.items():
        assert torch.allclose(p, ref_params[name], atol=1e-5, rtol=0), name


# -- single process ---------------------------------------------------------------------------

def test_basics_without_process_group():
    pm = GenMLP()
    cfg = pm.compute_config
    assert type(cfg).__name__ == "ComputeConfig" and cfg.plan_ngpus == 1 and not cfg.use_end2end
    assert (pm.rank, pm.device, pm.reducer, pm.grid.dp_size) == (0, torch.device("cpu"), None, 1)
    assert pm.fullmap["layers_0_weight"] == FullMapEntry("layers_0_weight", "layers.0.weight", (DIM, DIM),
                                                         ((0, DIM), (0, DIM)), (0, 1), 1)
    assert len(pm.parameters_for_optimizer()) == 2 * NLAYERS
    with pytest.raises(TypeError):
        pm.fullmap["x"] = None  # read-only view


def test_compute_config_is_the_typed_config():
    from nnscaler.ir import ComputeConfig, ConfigError
    cfg = make_compute_config({"plan_ngpus": 2, "runtime_ngpus": 4, "use_end2end": True})
    assert isinstance(cfg, ComputeConfig) and cfg.dp_size == 2 and cfg.use_async_reducer is False
    assert make_compute_config(cfg) is cfg
    with pytest.raises(ConfigError, match="unknown ComputeConfig field"):  # validated, not a loose namespace
        make_compute_config({"plan_ngpus": 1, "runtime_ngpus": 1, "use_zerro": True})


def test_load_full_state_and_forward():
    ref = MLP()
    pm = GenMLP()
    pm.load_full_state(ref.state_dict())
    data = batch(0)
    expected = ref(**data)
    assert torch.equal(pm(**data), expected)
    assert torch.equal(pm(data["x"], data["y"]), expected)  # positional and keyword alike
    assert torch.equal(pm(data["x"], y=data["y"]), expected)


def test_load_full_state_errors():
    pm = GenMLP()
    state = dict(MLP().state_dict())
    with pytest.raises(PlanMismatchError, match=r"unexpected extra\.weight"):
        pm.load_full_state({**state, "extra.weight": torch.zeros(1)})
    pm.load_full_state({**state, "extra.weight": torch.zeros(1)}, strict=False)
    del state["layers.1.bias"]
    with pytest.raises(PlanMismatchError, match=r"missing layers\.1\.bias"):
        pm.load_full_state(state)
    state["layers.1.bias"] = torch.zeros(DIM + 1)
    with pytest.raises(PlanMismatchError, match=r"'layers\.1\.bias' in the given state has shape \(9,\).*\(8,\)"):
        pm.load_full_state(state, strict=False)


class Pieces(ParallelModule):
    """A sliced parameter, a value-split buffer, a tied (aliased) parameter, a non-persistent buffer."""

    def __init__(self, init_params=False):
        super().__init__()
        self.register_parameter("w_part", torch.nn.Parameter(torch.empty(2, 3)))
        self.add_full_map("w_part", "w", full_shape=(4, 3), slices=((2, 4), (0, 3)), value_split=(0, 1))
        self.register_buffer("b0", torch.empty(3))
        self.add_full_map("b0", "b", full_shape=(3,), slices=((0, 3),), value_split=(0, 2))
        self.register_buffer("b1", torch.empty(3))
        self.add_full_map("b1", "b", full_shape=(3,), slices=((0, 3),), value_split=(1, 2))
        self.register_parameter("emb", torch.nn.Parameter(torch.empty(5)))
        self.add_full_map("emb", "emb.weight", full_shape=(5,), slices=((0, 5),))
        self.add_full_alias("head.weight", "emb")
        self.register_buffer("cache", torch.full((2,), 7.0), persistent=False)
        self.add_full_map("cache", "cache", full_shape=(2,), slices=((0, 2),))
        self._post_init(init_params)


def test_slices_value_split_and_aliases():
    full = {"w": torch.arange(12.0).view(4, 3), "b": torch.tensor([1.0, 2.0, 3.0]), "head.weight": torch.ones(5)}
    pm = Pieces()
    pm.load_full_state(full)  # tied param found under its alias; non-persistent buffer optional
    assert torch.equal(pm.w_part, full["w"][2:4])
    assert torch.equal(pm.b0, full["b"]) and torch.equal(pm.b1, torch.zeros(3))  # piece 0 holds the value
    assert torch.equal(pm.emb, torch.ones(5)) and torch.equal(pm.cache, torch.full((2,), 7.0))
    assert pm.full_aliases == {"head.weight": "emb"}
    pm.load_full_state({**full, "emb.weight": torch.zeros(5), "cache": torch.zeros(2)})
    assert torch.equal(pm.emb, torch.zeros(5)) and torch.equal(pm.cache, torch.zeros(2))
    with pytest.raises(PlanMismatchError, match="missing emb.weight"):
        pm.load_full_state({"w": full["w"], "b": full["b"]})


def test_generated_code_mistakes():
    class Bad(ParallelModule):
        def __init__(self, slices, alias=False, unmapped=False):
            super().__init__()
            self.register_parameter("w", torch.nn.Parameter(torch.empty(2, 3)))
            if unmapped:
                self._post_init(False)
            if alias:
                self.add_full_alias("v", "w")
            self.add_full_map("w", "w", full_shape=(4, 3), slices=slices)

    with pytest.raises(GenerationError, match=r"give shape \(1, 3\), the tensor has \(2, 3\)"):
        Bad(((0, 1), (0, 3)))
    with pytest.raises(GenerationError, match="outside full shape"):
        Bad(((3, 5), (0, 3)))
    with pytest.raises(GenerationError, match="add_full_map"):
        Bad(((0, 2), (0, 3)), alias=True)
    with pytest.raises(GenerationError, match="registers w without add_full_map"):
        Bad(((0, 2), (0, 3)), unmapped=True)
    with pytest.raises(GenerationError, match="no parameter or buffer 'nope'"):
        GenMLP().add_full_map("nope", "x", (1,), ((0, 1),))


class MetaInit(GenMLP):
    def register_parameter(self, name, param):
        super().register_parameter(name, torch.nn.Parameter(param.to("meta")) if param is not None else None)


def test_meta_parameters_are_materialized():
    pm = MetaInit()
    assert not any(p.is_meta for p in pm.parameters())
    ref = MLP()
    pm.load_full_state(ref.state_dict())
    assert torch.equal(pm(**batch(0)), ref(**batch(0)))


class Broken(GenMLP):
    def _forward_impl(self, x, y):
        x = F.linear(x, self.layers_0_weight)
        x = x.view(3, 5)  # BROKEN
        return x.sum()


def _line_of(func, marker):
    import inspect
    lines, start = inspect.getsourcelines(func)
    return start + next(i for i, line in enumerate(lines) if marker in line)


Broken.SOURCE_MAP = {_line_of(Broken._forward_impl, "# BROKEN"): "model.py:42 in MLP.forward (layers.0): x = x.view(3, 5)"}


def test_error_note_points_at_user_source():
    pm = Broken()
    with pytest.raises(RuntimeError) as info:
        pm(**batch(0))
    notes = info.value.__notes__
    assert len(notes) == 1
    assert notes[0].startswith("nnscaler: raised by model.py:42 in MLP.forward (layers.0): x = x.view(3, 5)")
    assert "test_module.py:" in notes[0]


GENERATED = '''\
import torch
import torch.nn.functional as F
from nnscaler.runtime.module import ParallelModule


class GenModel(ParallelModule):
    COMPUTE_CONFIG = {"plan_ngpus": 1, "runtime_ngpus": 1, "use_end2end": True}
    RANK = 0
    SOURCE_MAP = {SOURCE_MAP}

    def __init__(self, init_params=True):
        super().__init__()
        self.register_parameter("fc_weight", torch.nn.Parameter(torch.empty((4, 3))))
        self.add_full_map("fc_weight", "fc.weight", full_shape=(4, 3), slices=((0, 4), (0, 3)), value_split=(0, 1))
        self.register_parameter("w_half", torch.nn.Parameter(torch.empty((2, 3))))
        self.add_full_map("w_half", "big.weight", full_shape=(4, 3), slices=((2, 4), (0, 3)), value_split=(0, 1))
        self.register_buffer("bias", torch.empty(4))
        self.add_full_map("bias", "fc.bias", full_shape=(4,), slices=((0, 4),), value_split=(1, 2))
        self._post_init(init_params)

    def _forward_impl(self, x):
        y = F.linear(x, self.fc_weight, self.bias)
        z = torch.add(
            y.view(7, 7), 1)
        return z.sum()
'''


def _import_generated(directory, name):
    lines = GENERATED.splitlines()
    line = 1 + next(i for i, text in enumerate(lines) if "z = torch.add(" in text)
    source_map = {line: "model.py:9 in Net.forward: z = y.view(7, 7) + 1"}
    path = directory / "gencode0.py"
    path.write_text(GENERATED.replace("{SOURCE_MAP}", repr(source_map)))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_initial_weights_from_safetensors_next_to_generated_file(tmp_path):
    from safetensors.torch import save_file
    full = {"fc.weight": torch.randn(4, 3), "big.weight": torch.randn(4, 3), "fc.bias": torch.randn(4)}
    save_file(full, str(tmp_path / "fullmodel.safetensors"))
    try:
        gen = _import_generated(tmp_path, "nnscaler_test_gencode_a")
        pm = gen.GenModel()
        assert torch.equal(pm.fc_weight, full["fc.weight"]) and torch.equal(pm.w_half, full["big.weight"][2:])
        assert torch.equal(pm.bias, torch.zeros(4))
        with pytest.raises(RuntimeError) as info:
            pm(torch.randn(2, 3))  # the error is on the second line of a two-line statement
        assert info.value.__notes__[0].startswith("nnscaler: raised by model.py:9 in Net.forward: z = y.view(7, 7) + 1")
        assert str(tmp_path / "gencode0.py") in info.value.__notes__[0]
        (tmp_path / "fullmodel.safetensors").unlink()
        with pytest.raises(FileNotFoundError, match="fullmodel.safetensors not found.*init_params=False"):
            gen.GenModel()
        assert gen.GenModel(init_params=False).fc_weight.shape == (4, 3)
    finally:
        sys.modules.pop("nnscaler_test_gencode_a", None)


def test_end2end_steps():
    with pytest.raises(NnScalerError, match="use_end2end=True"):
        GenMLP().train_step([batch(0)])
    with pytest.raises(NnScalerError, match="use_end2end=True"):
        GenMLP().infer_step([batch(0)])
    with pytest.raises(NnScalerError, match="inference_only=True"):
        gen_class(use_end2end=True, inference_only=True)().train_step([batch(0)])
    state = MLP().state_dict()
    pm = gen_class(use_end2end=True)()
    pm.load_full_state(state)
    ref = MLP()
    ref.load_state_dict(state)
    samples = [batch(0, 4), (batch(1, 4)["x"], batch(1, 4)["y"])]  # kwargs dict, positional tuple
    outs = pm.train_step(samples)
    assert all(not o.requires_grad for o in outs)
    for s in samples:
        (ref(**s) if isinstance(s, dict) else ref(*s)).backward()
    for name, p in ref.named_parameters():
        assert torch.allclose(getattr(pm, local_name(name)).grad, p.grad, atol=1e-7)
    inferred = pm.infer_step(samples)
    assert [o.item() for o in inferred] == [o.item() for o in outs] and not inferred[0].requires_grad

    class NotScalar(GenMLP):
        COMPUTE_CONFIG = {"plan_ngpus": 1, "runtime_ngpus": 1, "use_end2end": True}

        def _forward_impl(self, x, y):
            return (x, y)
    with pytest.raises(NnScalerError, match="first output of forward must be the scalar loss"):
        NotScalar().train_step([batch(0)])


def test_train_step_scale_fn():
    """scale_fn is what backward runs on: a power-of-two scale gives exactly scaled gradients and
    the returned losses stay unscaled; bad scale_fns are refused naming the fix."""
    state = MLP().state_dict()
    samples = [batch(0, 4), batch(1, 4)]
    plain, scaled = gen_class(use_end2end=True)(), gen_class(use_end2end=True)()
    plain.load_full_state(state)
    scaled.load_full_state(state)
    outs = plain.train_step(samples)
    outs_scaled = scaled.train_step(samples, scale_fn=lambda loss: loss * 8)
    assert [o.item() for o in outs_scaled] == [o.item() for o in outs]
    for p, q in zip(plain.parameters(), scaled.parameters()):
        assert torch.equal(q.grad, p.grad * 8)
    pm = gen_class(use_end2end=True)()
    for bad, match in ((3.0, "scale_fn must be a callable"),
                       (lambda loss: 1.0, "must return the scaled loss.*float"),
                       (lambda loss: loss.expand(2), r"must return the scaled loss.*\(2,\)"),
                       (lambda loss: loss.detach(), "without gradient history")):
        with pytest.raises(NnScalerError, match=match):
            pm.train_step(samples, scale_fn=bad)


# -- multi-process parity -------------------------------------------------------------------------

def _train(cls, rank, world, mode, steps=STEPS):
    """Trains `cls` on this rank's slice of every global batch; returns losses (mean over
    ranks), final parameters and reducer counters."""
    pm = cls()
    pm.load_full_state(initial_state())
    opt = build_optimizer(pm, torch.optim.Adam, lr=LR)
    per = GLOBAL_BATCH // world
    losses, calls = [], []
    for s in range(steps):
        mine = {k: v[rank * per:(rank + 1) * per] for k, v in batch(s).items()}
        halves = [{k: v[:per // 2] for k, v in mine.items()}, {k: v[per // 2:] for k, v in mine.items()}]
        before = pm.reducer.stats.allreduce_calls
        opt.zero_grad()
        if mode == "plain":
            loss = pm(**mine)
            loss.backward()
        elif mode in ("accumulate", "accumulate_method"):
            loss = 0
            for i, half in enumerate(halves):
                ctx = sync_grad_when(i == 1) if mode == "accumulate" else pm.sync_grad_when(i == 1)
                with ctx:
                    part = pm(**half) * 0.5
                    part.backward()
                loss = loss + part.detach()
        elif mode == "train_step":
            outs = pm.train_step(halves)
            opt.scale_grads(0.5)
            loss = (outs[0] + outs[1]) / 2
        if s == 0:
            first_grads = {n: p.grad.clone() for n, p in pm.named_parameters()}
        opt.step()
        calls.append(pm.reducer.stats.allreduce_calls - before)
        t = loss.detach().reshape(1).clone()
        dist.all_reduce(t)
        losses.append(t.item() / world)
    params = {n: p.detach().clone() for n, p in pm.named_parameters()}
    return losses, params, first_grads, {"calls_per_step": calls, "buckets": pm.reducer.num_buckets}


CAP_3_BUCKETS = 288 / 2 ** 20  # a bucket closes once it holds a layer: weight 256 B + bias 32 B
RUNS = {
    "sync": ({}, "plain"),
    "async": ({"use_async_reducer": True}, "plain"),
    "sync_3_buckets": ({"reducer_bucket_cap_mb": CAP_3_BUCKETS}, "plain"),
    "async_tiny": ({"use_async_reducer": True, "reducer_bucket_cap_mb": 1e-9}, "plain"),
    "accumulate": ({"reducer_bucket_cap_mb": CAP_3_BUCKETS}, "accumulate"),
    "accumulate_async_method": ({"use_async_reducer": True}, "accumulate_method"),
    "train_step": ({"use_end2end": True, "use_async_reducer": True, "reducer_bucket_cap_mb": CAP_3_BUCKETS},
                   "train_step"),
}


def _parity_job(rank, world, names):
    out = {}
    for name in names:
        config, mode = RUNS[name]
        out[name] = _train(gen_class(runtime_ngpus=world, **config), rank, world, mode)
    if world == 2:
        wrong = type("GenMLP", (GenMLP,), {"COMPUTE_CONFIG": {"plan_ngpus": 2, "runtime_ngpus": 2}, "RANK": 0})
        try:
            wrong()
            out["mismatch"] = "no error" if rank == 1 else None
        except PlanMismatchError as e:
            out["mismatch"] = str(e)
        out["no_reducer"] = (
            gen_class(runtime_ngpus=2, inference_only=True)().reducer,
            type("GenMLP", (GenMLP,), {"COMPUTE_CONFIG": {"plan_ngpus": 2, "runtime_ngpus": 2}})().reducer)
    return out


def _check_parity(results, names):
    ref = reference()
    expected_buckets = {"sync": 1, "async": 1, "async_tiny": 2 * NLAYERS, "accumulate_async_method": 1}
    for rank, out in enumerate(results):
        for name in names:
            losses, params, grads, stats = out[name]
            assert_parity(losses, params, grads, ref)
            assert stats["buckets"] == expected_buckets.get(name, NLAYERS), name
            # one all-reduce per bucket per step, also when two micro-batches were accumulated
            assert stats["calls_per_step"] == [stats["buckets"]] * STEPS, name


@pytest.mark.multiprocess
def test_parity_two_ranks():
    names = list(RUNS)
    results = run_workers(_parity_job, 2, names)
    _check_parity(results, names)
    assert results[0]["mismatch"] is None
    assert "generated for plan device 0 but rank 1 runs plan device 1" in results[1]["mismatch"]
    assert results[0]["no_reducer"] == (None, None)


@pytest.mark.multiprocess
def test_parity_four_ranks():
    names = ["sync_3_buckets", "async_tiny", "train_step"]
    _check_parity(run_workers(_parity_job, 4, names), names)
