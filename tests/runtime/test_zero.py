"""ZeRO stage 1 (`nnscaler.runtime.zero`, `build_optimizer` with `use_zero=True`).

Single-process unit tests of the layout, the groups, the engine and the optimizer wrapper, then
one spawned job per world size (2 and 4 gloo ranks) that trains every case 5 Adam steps from the
same initial weights as single-process training: dp with the default all-reduce and with
reduce-scatter, zero_ngroups, tp 2 x dp 2, a container mixing a ParallelModule with a plain
nn.Linear head, accumulated micro-batches, padded buckets, a rank owning nothing, and clipping.
Losses, every parameter (assembled from the ranks' shards), gradient norms and Adam's exp_avg
(assembled from the ranks' optimizer states through the public `ZeroShardLayout` only) must match
the single-process run within 1e-5. The 2-rank job also checks fp32 master weights
(precision.with_master_weights) sharded by ZeRO against the same run without ZeRO, and the
collectives ZeRO runs (counted; native and forced fallbacks agree).
"""
from __future__ import annotations

import contextlib
import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import toy_models
from gpt import GPT, GPTConfig, random_batch
from launch import run_workers
from parity import assemble_full
from nnscaler.runtime.errors import ConfigError
from nnscaler.runtime.module import ParallelModule
from nnscaler.runtime.optimizer import build_optimizer
from nnscaler.ir import ComputeConfig
from nnscaler.runtime.zero import LAYOUT_VERSION, ZeroShardLayout, row_segments, make_zero_groups
from test_module import LR as UNIT_LR, MLP as UnitMLP, batch as unit_batch, gen_class, initial_state, local_name
from nnscaler.runtime.optimizer_state import optimizer_state

STEPS = 5
GLOBAL_BATCH = 8
LR = 1e-3
TOL = 1e-5
CLIP = 0.05  # small enough that clipping really scales the gradients
GPT_CFG = dict(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)


# -- single process ---------------------------------------------------------------------------------

def _unit_pair(**config):
    pm = gen_class(use_zero=True, **config)()
    pm.load_full_state(initial_state())
    ref = UnitMLP()
    ref.load_state_dict(initial_state())
    return pm, ref


def test_single_process_parity_layout_and_zero_grad():
    pm, ref = _unit_pair(reducer_bucket_cap_mb=288 / 2 ** 20)  # a bucket per layer (closes at the cap)
    opt = build_optimizer(pm, torch.optim.Adam, lr=UNIT_LR)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=UNIT_LR)
    assert isinstance(opt, torch.optim.Adam) and opt.zero_layout is not None
    assert build_optimizer(pm, torch.optim.Adam, lr=UNIT_LR).zero_layout.to_dict() == opt.zero_layout.to_dict()
    for s in range(3):
        opt.zero_grad()
        pm(**unit_batch(s)).backward()
        norm = opt.clip_gnorm(0.05)
        opt.step()
        ref_opt.zero_grad()
        ref(**unit_batch(s)).backward()
        assert torch.allclose(norm, torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05), rtol=1e-6)
        ref_opt.step()
    for name, p in ref.named_parameters():
        assert torch.allclose(getattr(pm, local_name(name)), p, atol=1e-7), name
    layout = opt.zero_layout
    assert layout.group_ranks == (0,) and layout.group_index == 0 and layout.padding == 0
    assert len(layout.buckets) == 3 and [len(b.tensors) for b in layout.buckets] == [2, 2, 2]
    assert [p.full_name for p in layout.pieces] == [n for n, _ in ref.named_parameters()]
    assert sorted(p.state_index for p in layout.pieces) == list(range(6))
    # the layout is JSON and reads back; unknown versions are refused
    data = json.loads(json.dumps(layout.to_dict()))
    assert ZeroShardLayout.from_dict(data) == layout
    with pytest.raises(ValueError, match="version"):
        ZeroShardLayout.from_dict({**data, "version": LAYOUT_VERSION + 1})
    # zero_grad clears the parameters' gradients and the shard gradients
    pm(**unit_batch(0)).backward()
    opt.sync_shard_grad()
    assert all(t.grad is not None for g in opt.param_groups for t in g["params"])
    opt.zero_grad()
    assert all(p.grad is None for p in pm.parameters())
    assert all(t.grad is None for g in opt.param_groups for t in g["params"])
    pm(**unit_batch(0)).backward()
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in pm.parameters())


def test_sync_once_per_step_scale_grads_and_closure():
    pm, ref = _unit_pair()
    opt = build_optimizer(pm, torch.optim.SGD, lr=0.1)
    pieces = [t for g in opt.param_groups for t in g["params"]]
    pm(**unit_batch(0)).backward()
    assert all(t.grad is None for t in pieces) and not optimizer_state(opt).zero.synced
    ref(**unit_batch(0)).backward()
    full = torch.nn.utils.clip_grad_norm_(ref.parameters(), float("inf"))
    opt.scale_grads(0.5)  # syncs, then scales the shard gradients (p.grad is left as backward left it)
    assert optimizer_state(opt).zero.synced and all(t.grad is not None for t in pieces)
    assert torch.allclose(opt.clip_gnorm(), full * 0.5, rtol=1e-6)
    assert torch.equal(pm.layers_0_bias.grad, ref.layers[0].bias.grad)
    before = pm.layers_0_bias.detach().clone()
    opt.step()
    assert torch.allclose(pm.layers_0_bias, before - 0.1 * 0.5 * ref.layers[0].bias.grad, atol=1e-7)
    assert optimizer_state(opt).zero.stats.syncs == 1 and not optimizer_state(opt).zero.synced
    # without zero_grad the next step syncs afresh from the accumulated p.grad
    pm(**unit_batch(1)).backward()
    opt.sync_shard_grad()
    assert torch.equal(pieces[1].grad, pm.layers_0_bias.grad)
    # a closure is evaluated first, with gradients enabled; its gradients are the ones stepped on
    opt.zero_grad()
    with torch.no_grad():
        loss = opt.step(lambda: pm(**unit_batch(1)).backward() or torch.tensor(1.0))
    assert loss.item() == 1.0 and all(p.grad is not None for p in pm.parameters())
    assert optimizer_state(opt).zero.stats.syncs == 3


def test_with_master_weights_shards_the_masters():
    from nnscaler.runtime.precision import with_master_weights
    pm, ref = _unit_pair()
    pm.to(torch.bfloat16)
    opt = with_master_weights(build_optimizer(pm, torch.optim.Adam, lr=UNIT_LR))
    held = [t for g in opt.param_groups for t in g["params"]]
    assert all(t.dtype == torch.float32 for t in held) and opt.zero_layout.buckets[0].dtype == "bfloat16"
    for step in range(2):
        opt.zero_grad()
        pm(**{k: v.bfloat16() for k, v in unit_batch(step).items()}).backward()
        opt.clip_gnorm(0.05)
        opt.step()
    sd = opt.state_dict()
    assert all(s["exp_avg"].dtype == torch.float32 for s in sd["state"].values())
    for piece in opt.zero_layout.pieces:
        param = getattr(pm, piece.local_name)
        master = sd["master_weights"][piece.state_index]
        assert param.dtype == torch.bfloat16 and master.numel() == piece.numel
        assert torch.equal(param.detach().reshape(-1)[piece.start:piece.stop], master.to(torch.bfloat16))
        assert not torch.equal(master, initial_state()[piece.full_name].reshape(-1)[piece.start:piece.stop])


def test_state_dict_holds_the_shard_and_round_trips():
    pm, _ = _unit_pair(reducer_bucket_cap_mb=288 / 2 ** 20)
    opt = build_optimizer(pm, torch.optim.Adam, lr=UNIT_LR)
    pm(**unit_batch(0)).backward()
    opt.step()
    sd = opt.state_dict()
    assert sorted(sd["state"]) == [p.state_index for p in opt.zero_layout.pieces]
    assert all(sd["state"][p.state_index]["exp_avg"].shape == (p.numel,) for p in opt.zero_layout.pieces)
    again = build_optimizer(pm, torch.optim.Adam, lr=UNIT_LR)
    calls = []
    again.register_step_pre_hook(lambda *args: calls.append(1))
    again.load_state_dict(sd)
    for k, state in sd["state"].items():
        assert torch.equal(again.state_dict()["state"][k]["exp_avg"], state["exp_avg"])
    again.zero_grad()
    pm(**unit_batch(1)).backward()
    again.step()
    assert calls == [1]  # step hooks run once (also after load_state_dict re-patched the class)


class _Two(nn.Module):
    def __init__(self, a, b):
        super().__init__()
        self.a, self.b = a, b


def test_errors():
    with pytest.raises(ConfigError, match="same use_zero, zero_ngroups and zero_use_reduce_scatter"):
        build_optimizer(_Two(gen_class(use_zero=True)(), gen_class()()), torch.optim.Adam)
    pm = gen_class(use_zero=True)()
    with pytest.raises(ConfigError, match="must optimize exactly the tensors it is given"):
        build_optimizer(pm, lambda params, **kw: torch.optim.Adam(list(params)[:2], **kw), lr=0.1)
    # a factory keeping every tensor (here: in two param groups) is fine
    opt = build_optimizer(pm, lambda params: torch.optim.SGD(
        [{"params": params[:3]}, {"params": params[3:], "lr": 0.0}], lr=0.1))
    assert [p.state_index for p in opt.zero_layout.pieces] == list(range(6))


class _FakeGrid:
    """A RankGrid's layout without process groups; records the groups asked for."""

    def __init__(self, plan, world, rank):
        self.plan_ngpus, self.runtime_ngpus, self.rank = plan, world, rank
        self.dp_size, self.dp_rank, self.plan_device = world // plan, rank // plan, rank % plan
        self.sync_ranks = self.sync_ranks_of(self.plan_device)
        self.asked = []

    def sync_ranks_of(self, d):
        return tuple(range(d, self.runtime_ngpus, self.plan_ngpus))

    def group(self, ranks):
        self.asked.append(tuple(ranks))
        return f"group{tuple(ranks)}"


def test_zero_groups_are_contiguous_slices_of_the_sync_group():
    grids = [_FakeGrid(2, 8, r) for r in range(8)]  # dp 4, zero_ngroups 2: groups of 2
    groups = [make_zero_groups(g, 2) for g in grids]
    assert all(g.asked == grids[0].asked for g in grids)  # every rank creates the same groups, in order
    g5 = groups[5]  # plan device 1: sync ranks (1, 3, 5, 7)
    assert (g5.group_ranks, g5.group_index, g5.group_id, g5.cross_ranks, g5.norm_ranks) == \
        ((5, 7), 0, 1, (1, 5), (4, 5, 6, 7))
    assert g5.group == "group(5, 7)" and g5.cross_group == "group(1, 5)"
    assert [g.group_ranks for g in groups] == [(0, 2), (1, 3), (0, 2), (1, 3), (4, 6), (5, 7), (4, 6), (5, 7)]
    one = make_zero_groups(_FakeGrid(1, 4, 2), 4)  # zero_ngroups == dp: nothing sharded, no zero group
    assert one.group_ranks == (2,) and one.group is None and one.cross_ranks == (0, 1, 2, 3)
    with pytest.raises(ConfigError, match=r"zero_ngroups \(3\) must divide the data-parallel"):  # checked once, there
        ComputeConfig(1, 4, use_zero=True, zero_ngroups=3)


def test_row_segments():
    assert list(row_segments(3, 7, 4)) == [(0, 3, 0, 1), (1, 0, 1, 4), (2, 0, 5, 2)]
    assert list(row_segments(8, 4, 4)) == [(2, 0, 0, 4)]


# -- multi-process parity ---------------------------------------------------------------------------

class Body(nn.Module):
    def __init__(self, dim=16, nlayers=2):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(nlayers))

    def forward(self, x):
        for layer in self.layers:
            x = F.gelu(layer(x))
        return x


class Container(nn.Module):
    """A body that gets parallelized and a plain head that does not."""

    def __init__(self):
        super().__init__()
        self.body = Body()
        self.head = nn.Linear(16, 1)

    def forward(self, x, y):
        return F.mse_loss(self.head(self.body(x)).squeeze(-1), y)


class Tiny(nn.Module):
    """Two trainable elements: at dp 4 two ranks own nothing (an empty placeholder shard)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(1, 1)

    def forward(self, x, y):
        return F.mse_loss(self.fc(x).squeeze(-1), y)


def _make(model):
    torch.manual_seed(0)
    return {"mlp": lambda: toy_models.MLP(), "mlp5": lambda: toy_models.MLP(dim=5),
            "gpt": lambda: GPT(GPTConfig(**GPT_CFG)), "container": Container, "tiny": Tiny}[model]()


def _batch(model, step, n):
    if model == "gpt":
        return random_batch(step, n, GPTConfig(**GPT_CFG))
    return toy_models.mlp_batch(step, n, dim={"mlp5": 5, "tiny": 1}.get(model, 16))


# name -> (model, policy, plan_ngpus, zero_ngroups, reduce_scatter, clip, extra config, mode)
CASES = {
    2: {
        "mlp_dp2": ("mlp", "dp", 1, 1, False, False, {}, "plain"),
        "mlp_dp2_rs_accum": ("mlp", "dp", 1, 1, True, False, {"reducer_bucket_cap_mb": 1e-3}, "accum"),
        "gpt_dp2_rs_clip": ("gpt", "dp", 1, 1, True, True, {}, "plain"),
        "container_dp2_clip": ("container", "dp", 1, 1, False, True, {}, "plain"),
    },
    4: {
        "mlp_dp4": ("mlp", "dp", 1, 1, False, False, {}, "plain"),
        "mlp_dp4_g2": ("mlp", "dp", 1, 2, False, True, {}, "plain"),
        "mlp_dp4_rs_g2": ("mlp", "dp", 1, 2, True, True, {}, "plain"),
        "mlp5_dp4_rs_pad": ("mlp5", "dp", 1, 1, True, False, {"reducer_bucket_cap_mb": 1e-6}, "plain"),
        "gpt_tp2_dp2_clip": ("gpt", "tp", 2, 1, False, True, {}, "plain"),
        "mlp_tp2_dp2_rs_g2": ("mlp", "tp", 2, 2, True, True, {}, "plain"),
        "container_dp4_rs_g2_clip": ("container", "dp", 1, 2, True, True, {}, "plain"),
        "tiny_dp4_rs": ("tiny", "dp", 1, 1, True, False, {}, "plain"),
    },
}


def reference(model, clip):
    m = _make(model)
    opt = torch.optim.Adam(m.parameters(), lr=LR)
    losses, norms = [], []
    for step in range(STEPS):
        loss = m(**_batch(model, step, GLOBAL_BATCH))
        opt.zero_grad()
        loss.backward()
        if clip:
            norms.append(torch.nn.utils.clip_grad_norm_(m.parameters(), CLIP).item())
        opt.step()
        losses.append(loss.item())
    params = {n: p.detach().clone() for n, p in m.named_parameters()}
    exp_avg = {n: opt.state[p]["exp_avg"].clone() for n, p in m.named_parameters()}
    return losses, norms, params, exp_avg


def _tensors(model):
    """(full name, full shape, slices, tensor) of every parameter on this rank."""
    out, seen = [], set()
    for path, m in model.named_modules():
        if isinstance(m, ParallelModule):
            for local, e in m.fullmap.items():
                t = m.local_tensor(local)[0]
                if not isinstance(t, nn.Parameter):
                    continue
                seen.add(id(t))
                out.append((f"{path}.{e.full_name}" if path else e.full_name, e.full_shape, e.slices, t))
    for name, p in model.named_parameters():
        if id(p) not in seen:
            out.append((name, tuple(p.shape), tuple((0, d) for d in p.shape), p))
    return out


def train(rank, world, name, gen_dir):
    import torch.distributed as dist
    from nnscaler import ComputeConfig, parallelize

    model_name, policy, plan, ngroups, rs, clip, extra, mode = CASES[world][name]
    dp = world // plan
    per = GLOBAL_BATCH // dp
    dp_rank = rank // plan
    cfg = ComputeConfig(plan, world, trace_strategy="cpu", use_zero=True, zero_ngroups=ngroups,
                        zero_use_reduce_scatter=rs, **extra)
    model = _make(model_name)
    if model_name == "container":
        model.body = parallelize(model.body, {"x": _batch(model_name, 0, per)["x"]}, policy, cfg,
                                 gen_savedir=gen_dir, instance_name=name)
        pms = [model.body]
    else:
        model = parallelize(model, _batch(model_name, 0, per), policy, cfg, gen_savedir=gen_dir, instance_name=name)
        pms = [model]
    opt = build_optimizer(model, torch.optim.Adam, lr=LR)
    losses, norms = [], []
    for step in range(STEPS):
        full = _batch(model_name, step, GLOBAL_BATCH)
        mine = {k: v[dp_rank * per:(dp_rank + 1) * per] for k, v in full.items()}
        opt.zero_grad()
        assert all(p.grad is None for p in model.parameters())
        if mode == "accum":  # two micro-batches: the first accumulates locally, the second reduces
            loss = 0
            halves = ({k: v[:per // 2] for k, v in mine.items()}, {k: v[per // 2:] for k, v in mine.items()})
            for i, half in enumerate(halves):
                with pms[0].sync_grad_when(i == 1):
                    part = model(**half) * 0.5
                    part.backward()
                loss = loss + part.detach()
        else:
            loss = model(**mine)
            loss.backward()
        if clip:
            norms.append(opt.clip_gnorm(CLIP).item())
        opt.step()
        t = loss.detach().reshape(1).clone()
        dist.all_reduce(t)
        losses.append(t.item() / world)
    layout = opt.zero_layout.to_dict()
    json.dumps(layout)  # JSON-able
    state = opt.state_dict()["state"]
    stats = optimizer_state(opt).zero.stats
    return dict(
        losses=losses, norms=norms, layout=layout,
        tensors=[(n, s, sl, t.detach().clone()) for n, s, sl, t in _tensors(model)],
        exp_avg={k: v["exp_avg"].clone() for k, v in state.items()},
        n_opt_params=sum(len(g["params"]) for g in opt.param_groups),
        local_numel=sum(p.numel() for p in model.parameters() if p.requires_grad),
        reducers=[pm.reducer is not None for pm in pms],
        rs_calls=stats.reduce_scatter_calls, cross_calls=stats.cross_all_reduce_calls,
        gather_calls=stats.all_gather_calls)


def train_masters(rank, world, mode):
    """bf16 parameters with precision's fp32 master weights, with clipping."""
    from nnscaler.runtime.precision import with_master_weights
    use_zero = mode != "plain"
    pm = gen_class(runtime_ngpus=world, use_zero=use_zero, zero_use_reduce_scatter=mode == "zero_rs")()
    pm.load_full_state(initial_state())
    pm.to(torch.bfloat16)
    opt = with_master_weights(build_optimizer(pm, torch.optim.Adam, lr=UNIT_LR))
    per = GLOBAL_BATCH // world
    for step in range(3):
        opt.zero_grad()
        pm(**{k: v[rank * per:(rank + 1) * per].bfloat16() for k, v in unit_batch(step).items()}).backward()
        opt.clip_gnorm(0.05)
        opt.step()
    params = {n: p.detach().clone() for n, p in pm.named_parameters()}
    if not use_zero:
        return params, {n: opt.master_of(p).detach().clone() for n, p in pm.named_parameters()}, None
    return params, dict(opt.state_dict()["master_weights"]), opt.zero_layout.to_dict()


def train_comm(rank, world, fallback):
    """Two reduce-scatter steps, counting the collectives; with the fallbacks forced or native."""
    from nnscaler.runtime.comm import count_collectives, force_fallback
    pm = gen_class(runtime_ngpus=world, use_zero=True, zero_use_reduce_scatter=True)()
    pm.load_full_state(initial_state())
    opt = build_optimizer(pm, torch.optim.Adam, lr=UNIT_LR)
    per = GLOBAL_BATCH // world
    with count_collectives() as stats, (force_fallback() if fallback else contextlib.nullcontext()):
        for step in range(2):
            opt.zero_grad()
            pm(**{k: v[rank * per:(rank + 1) * per] for k, v in unit_batch(step).items()}).backward()
            opt.step()
    return {n: p.detach().clone() for n, p in pm.named_parameters()}, stats.snapshot()


def run_cases(rank, world, gen_dir):
    out = {name: train(rank, world, name, gen_dir) for name in CASES[world]}
    if world == 2:
        out["masters"] = [train_masters(rank, world, mode) for mode in ("plain", "zero", "zero_rs")]
        out["comm"] = [train_comm(rank, world, fallback) for fallback in (False, True)]
    return out


def _check_comm(results):
    """216 elements in one bucket, 2 ranks: each step one reduce-scatter of 2 x (108 + 6 flags)
    floats and one all-gather of 108; no all-reduce of the gradients; the fallbacks agree."""
    for r in results:
        (native, stats), (fallback, fb_stats) = r["comm"]
        assert stats == {"zero_all_gather": {"calls": 2, "bytes": 2 * 108 * 4},
                         "zero_reduce_scatter": {"calls": 2, "bytes": 2 * 2 * 114 * 4}}, stats
        assert fb_stats == {"zero_all_gather(fallback)": {"calls": 2, "bytes": 2 * 108 * 4},
                            "zero_reduce_scatter(fallback)": {"calls": 2, "bytes": 2 * 2 * 114 * 4}}, fb_stats
        for n, p in native.items():
            assert torch.equal(p, fallback[n]), n
            assert torch.equal(p, results[0]["comm"][0][0][n]), n


def _check_masters(results):
    """ZeRO + fp32 masters: the masters are sharded (each rank holds its pieces only) and training
    matches the same run without ZeRO."""
    plain_params, plain_masters, _ = results[0]["masters"][0]
    for mode in (1, 2):  # ZeRO with all-reduce, with reduce-scatter
        masters = {n: torch.full((m.numel(),), float("nan")) for n, m in plain_masters.items()}
        for r in results:
            params, shard, layout = r["masters"][mode]
            assert sum(t.numel() for t in shard.values()) == sum(m.numel() for m in plain_masters.values()) // 2
            for piece in layout["pieces"]:
                masters[piece["local_name"]][piece["start"]:piece["stop"]] = shard[piece["state_index"]]
            for n, p in params.items():
                assert p.dtype == torch.bfloat16 and torch.equal(p, plain_params[n]), (mode, n)
        for n, m in masters.items():
            assert torch.allclose(m.view_as(plain_masters[n]), plain_masters[n], atol=1e-6, rtol=0), (mode, n)


def _assemble_params(results, name):
    return assemble_full(((r, per_rank[name]["tensors"]) for r, per_rank in enumerate(results)), name)


def _assemble_state(results, name):
    """Adam's exp_avg as full tensors, from the ranks' states and layouts only; checks that each
    zero group's pieces cover every element of every local tensor exactly once."""
    local = {}  # (plan device, zero group id, module path, local name) -> (counts, values, piece)
    for rank, per_rank in enumerate(results):
        out = per_rank[name]
        layout = out["layout"]
        assert layout["rank"] == rank and layout["group_ranks"][layout["group_index"]] == rank
        for piece in layout["pieces"]:
            key = (rank % layout["plan_ngpus"], layout["group_id"], piece["module_path"], piece["local_name"])
            numel = 1
            for d in piece["local_shape"]:
                numel *= d
            counts, values, _ = local.setdefault(key, (torch.zeros(numel, dtype=torch.int64),
                                                       torch.zeros(numel), piece))
            counts[piece["start"]:piece["stop"]] += 1
            values[piece["start"]:piece["stop"]] = out["exp_avg"][piece["state_index"]]
    full = {}
    for key, (counts, values, piece) in local.items():
        assert (counts == 1).all(), f"{name}: {key} is not covered exactly once by its zero group"
        fname = f"{piece['module_path']}.{piece['full_name']}" if piece["module_path"] else piece["full_name"]
        tensor = full.setdefault(fname, torch.full(tuple(piece["full_shape"]), float("nan")))
        index = tuple(slice(a, b) for a, b in piece["slices"])
        value = values.view(tuple(piece["local_shape"]))
        if not torch.isnan(tensor[index]).all():  # another zero group / tp replica: the same state
            assert torch.allclose(tensor[index], value, atol=1e-7), f"{name}: copies of the state of {fname} differ"
        tensor[index] = value
    return full


def _check(world, results):
    refs = {}
    for name, (model, policy, plan, ngroups, rs, clip, extra, mode) in CASES[world].items():
        if (model, clip) not in refs:
            refs[model, clip] = reference(model, clip)
        ref_losses, ref_norms, ref_params, ref_exp_avg = refs[model, clip]
        out = results[0][name]
        for step, (got, want) in enumerate(zip(out["losses"], ref_losses)):
            assert abs(got - want) <= TOL * max(1.0, abs(want)), f"{name} step {step}: {got} vs {want}"
        for r in results:
            assert r[name]["norms"] == pytest.approx(ref_norms, rel=TOL), name
        params = _assemble_params(results, name)
        assert set(params) <= set(ref_params) and len(params) >= len(ref_params) - 1, name  # tied: one name
        for pname, value in params.items():
            diff = (value - ref_params[pname]).abs().max().item()
            assert diff <= TOL, f"{name}: parameter {pname} differs by {diff}"
        state = _assemble_state(results, name)
        assert set(state) == set(params), name
        for pname, value in state.items():
            assert torch.allclose(value, ref_exp_avg[pname], atol=1e-6, rtol=1e-4), f"{name}: exp_avg of {pname}"
        # the state is sharded: each rank holds ~1/z of it, the zero group all of it
        dp, z = world // plan, world // plan // ngroups
        for rank, r in enumerate(results):
            out, layout = r[name], r[name]["layout"]
            assert len(layout["group_ranks"]) == z and layout["reduce_scatter"] == rs and layout["ngroups"] == ngroups
            owned = sum(v.numel() for v in out["exp_avg"].values())
            assert owned == sum(p["stop"] - p["start"] for p in layout["pieces"])
            padded = sum(b["padded_numel"] for b in layout["buckets"])
            assert sum(b["numel"] for b in layout["buckets"]) == out["local_numel"]
            assert padded - out["local_numel"] < z * len(layout["buckets"])
            assert padded // z - (padded - out["local_numel"]) <= owned <= padded // z, (name, rank)
            # reduce-scatter replaces the module's all-reduce for the ParallelModule tensors
            assert out["reducers"] == [not rs and dp > 1], name
            n_rs = sum(b["reduce_scatter"] for b in layout["buckets"])
            assert out["rs_calls"] == (n_rs * STEPS if z > 1 else 0), name
            assert out["cross_calls"] == (n_rs * STEPS if ngroups > 1 else 0), name
            assert out["gather_calls"] == (len(layout["buckets"]) * STEPS if z > 1 else 0), name
    return refs


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 4])
def test_zero_parity(world, tmp_path):
    results = run_workers(run_cases, world, str(tmp_path / "gen"), timeout=300)
    _check(world, results)
    if world == 2:
        _check_masters(results)
        _check_comm(results)
    if world == 4:
        pad = [r["mlp5_dp4_rs_pad"]["layout"] for r in results]
        assert len(pad[0]["buckets"]) == 6  # one per tensor: 25 and 5 elements, padded to 28 and 8
        assert [b["padded_numel"] - b["numel"] for b in pad[0]["buckets"]] == [3, 3] * 3
        assert [len(layout["pieces"]) for layout in pad] == [6, 6, 6, 3]  # rank 3 owns only padding of the biases
        tiny = [r["tiny_dp4_rs"] for r in results]
        assert [len(t["layout"]["pieces"]) for t in tiny] == [1, 1, 0, 0]
        assert [t["n_opt_params"] for t in tiny] == [1, 1, 1, 1]  # an empty placeholder where nothing is owned
        assert tiny[2]["exp_avg"] == {}


def test_zero_groups_share_the_layout_geometry():
    import dataclasses
    from nnscaler.ir.contracts import ZeroGeometry, ZeroShardLayout
    from nnscaler.runtime.zero_groups import ZeroGroups
    assert issubclass(ZeroGroups, ZeroGeometry)
    groups = ZeroGroups(1, 4, 2, 2, 1, (1, 3), 0, 0, (1,), (0, 1, 2, 3))
    layout = ZeroShardLayout(**groups.geometry(), version=1, reduce_scatter=True, buckets=(), pieces=())
    names = [f.name for f in dataclasses.fields(ZeroGeometry)]
    assert [getattr(layout, n) for n in names] == [getattr(groups, n) for n in names]
    assert groups.size == layout.group_size == 2
