import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from launch import run_workers
from nnscaler.runtime.module import ParallelModule
from nnscaler.runtime.optimizer import build_optimizer
from test_module import DIM, LR, MLP, GenMLP, assert_parity, batch, initial_state, local_name, reference
from nnscaler.runtime.optimizer_state import module_state, optimizer_state



class GenBody(ParallelModule):
    """One generated Linear + gelu, used inside an ordinary container module."""

    COMPUTE_CONFIG = {"plan_ngpus": 1, "runtime_ngpus": 1}

    def __init__(self, init_params=False):
        super().__init__()
        for kind, shape in (("weight", (DIM, DIM)), ("bias", (DIM,))):
            self.register_parameter(kind, torch.nn.Parameter(torch.empty(shape)))
            self.add_full_map(kind, f"body.{kind}", full_shape=shape, slices=tuple((0, d) for d in shape))
        self._post_init(init_params)

    def _forward_impl(self, x):
        return F.gelu(F.linear(x, self.weight, self.bias))


class RefContainer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.body = torch.nn.Linear(DIM, DIM)
        self.head = torch.nn.Linear(DIM, DIM)

    def forward(self, x, y):
        return F.mse_loss(self.head(F.gelu(self.body(x))).sum(-1), y)


class Container(RefContainer):
    """An ordinary module holding a ParallelModule and an ordinary (replicated) head."""

    def __init__(self, body_cls):
        super().__init__()
        ref = self.body
        self.body = body_cls()
        self.body.load_full_state({f"body.{n}": t for n, t in ref.state_dict().items()})

    def forward(self, x, y):
        return F.mse_loss(self.head(self.body(x)).sum(-1), y)


def _with_grads(module, seed=0):
    module.zero_grad()
    module(**batch(seed)).backward()


def test_errors():
    with pytest.raises(TypeError, match="optimizer_fn must be an optimizer class or a factory"):
        build_optimizer(GenMLP(), "adam")
    with pytest.raises(TypeError, match="MLP is not a ParallelModule and contains none: parallelize"):
        build_optimizer(MLP(), torch.optim.Adam)
    with pytest.raises(TypeError, match="returned list, not a torch.optim.Optimizer"):
        build_optimizer(GenMLP(), lambda params: list(params))


def test_optimizer_class_and_back_reference():
    pm = GenMLP()
    opt = build_optimizer(pm, torch.optim.Adam, lr=LR, betas=(0.8, 0.9))
    assert isinstance(opt, torch.optim.Adam) and type(opt).__name__ == "NnScalerAdam"
    assert optimizer_state(opt).module is pm and opt.defaults["betas"] == (0.8, 0.9)
    assert [id(p) for p in opt.param_groups[0]["params"]] == [id(p) for p in pm.parameters_for_optimizer()]
    assert type(build_optimizer(pm, torch.optim.Adam)) is type(opt)  # one subclass per optimizer class
    sgd = build_optimizer(pm, lambda params, lr: torch.optim.SGD(params, lr=lr), lr=0.5)  # a factory
    assert isinstance(sgd, torch.optim.SGD) and sgd.defaults["lr"] == 0.5
    sgd.sync_shard_grad()  # no-op without ZeRO


def test_frozen_parameters_are_left_out():
    pm = GenMLP()
    pm.layers_0_weight.requires_grad_(False)
    opt = build_optimizer(pm, torch.optim.SGD, lr=0.1)
    assert len(opt.param_groups[0]["params"]) == 5


def test_clip_gnorm_matches_torch_and_scale_grads():
    state = initial_state()
    pm, ref = GenMLP(), MLP()
    pm.load_full_state(state)
    ref.load_state_dict(state)
    opt = build_optimizer(pm, torch.optim.SGD, lr=0.1)
    _with_grads(pm)
    _with_grads(ref)
    expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm=float("inf"))
    norm = opt.clip_gnorm()  # no max_norm: only measures
    assert torch.allclose(norm, expected, rtol=1e-6) and norm.dim() == 0
    expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm=0.01)
    assert torch.allclose(opt.clip_gnorm(0.01), expected, rtol=1e-6)
    for n, p in ref.named_parameters():
        assert torch.allclose(getattr(pm, local_name(n)).grad, p.grad, rtol=1e-6, atol=1e-9)
    assert torch.allclose(opt.clip_gnorm(), torch.tensor(0.01), rtol=1e-4)
    opt.scale_grads(0.5)
    assert torch.allclose(opt.clip_gnorm(), torch.tensor(0.005), rtol=1e-4)
    opt.zero_grad()
    assert opt.clip_gnorm().item() == 0.0


def test_clip_gnorm_of_float64_gradients_is_float64_exact():
    """The norm is summed in float64: clipping float64 gradients matches torch's to 1e-15, not to
    float32's 1e-7 (which put float64 matrix cases with clipping 1e-9 off one process after Adam)."""
    state = initial_state()
    pm, ref = GenMLP().double(), MLP().double()
    pm.load_full_state({k: v.double() for k, v in state.items()})
    ref.load_state_dict({k: v.double() for k, v in state.items()})
    opt = build_optimizer(pm, torch.optim.SGD, lr=0.1)
    pm.zero_grad(), ref.zero_grad()
    pm(**{k: v.double() for k, v in batch(0).items()}).backward()
    ref(**{k: v.double() for k, v in batch(0).items()}).backward()
    expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm=0.01)
    norm = opt.clip_gnorm(0.01)
    assert norm.dtype == torch.float64
    assert abs(norm.item() - expected.item()) <= 1e-15 * expected.item()
    for n, p in ref.named_parameters():
        assert (getattr(pm, local_name(n)).grad - p.grad).abs().max().item() <= 1e-17


def test_container_optimizes_all_parameters():
    model = Container(GenBody)
    opt = build_optimizer(model, torch.optim.Adam, lr=LR)
    assert {id(p) for p in opt.param_groups[0]["params"]} == {id(p) for p in model.parameters()}
    assert optimizer_state(opt).module is model
    ref = RefContainer()
    _with_grads(model)
    _with_grads(ref)
    assert torch.allclose(opt.clip_gnorm(), torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9), rtol=1e-6)


# -- multi-process --------------------------------------------------------------------------------

CLIP = 0.05


def _container_reference(steps):
    model = RefContainer()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    losses, norms = [], []
    for s in range(steps):
        opt.zero_grad()
        loss = model(**batch(s))
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
        losses.append(loss.item())
    return losses, norms, {n: p.detach() for n, p in model.named_parameters()}


def _loop(model, opt, data_rank, dp, steps):
    per = 8 // dp
    losses, norms = [], []
    for s in range(steps):
        mine = {k: v[data_rank * per:(data_rank + 1) * per] for k, v in batch(s).items()}
        opt.zero_grad()
        loss = model(**mine)
        loss.backward()
        if s == 0:
            first_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        norms.append(opt.clip_gnorm(CLIP).item())
        opt.step()
        t = loss.detach().reshape(1).clone()
        dist.all_reduce(t)
        losses.append(t.item() / dist.get_world_size())
    return losses, norms, {n: p.detach().clone() for n, p in model.named_parameters()}, first_grads


def _optimizer_job(rank, world, steps):
    out = {}
    # dp over 4 ranks: a ParallelModule plus an ordinary head, synced by an extra reducer
    body = type("GenBody", (GenBody,), {"COMPUTE_CONFIG": {"plan_ngpus": 1, "runtime_ngpus": world}})
    model = Container(body)
    opt = build_optimizer(model, torch.optim.Adam, lr=LR)
    out["container"] = _loop(model, opt, rank, world, steps)
    out["extra_reducer"] = module_state(model).plain_reducer.num_buckets
    # plan_ngpus=2: both plan devices hold the whole model (replicas=2), dp=2
    cls = type("GenMLP", (GenMLP,), {"REPLICAS": 2, "COMPUTE_CONFIG": {"plan_ngpus": 2, "runtime_ngpus": world}})
    pm = cls()
    pm.load_full_state(initial_state())
    opt = build_optimizer(pm, torch.optim.Adam, lr=LR)
    out["replicated"] = _loop(pm, opt, pm.grid.dp_rank, pm.grid.dp_size, steps)
    return out


@pytest.mark.multiprocess
def test_four_ranks_container_and_replicated_plan():
    steps = 3
    results = run_workers(_optimizer_job, 4, steps)
    ref_losses, ref_norms, ref_params = _container_reference(steps)
    mlp_losses, mlp_params, mlp_norms, mlp_grads = reference(steps, clip=CLIP)
    for out in results:
        losses, norms, params, _ = out["container"]
        assert out["extra_reducer"] == 1
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        assert norms == pytest.approx(ref_norms, rel=1e-5)
        for n, p in params.items():
            assert torch.allclose(p, ref_params[n], atol=1e-5, rtol=0), n
        losses, norms, params, grads = out["replicated"]
        assert norms == pytest.approx(mlp_norms, rel=1e-5)
        assert_parity(losses, params, grads, (mlp_losses, mlp_params, mlp_norms, mlp_grads))
