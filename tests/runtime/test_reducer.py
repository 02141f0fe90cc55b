import pytest
import torch
import torch.distributed as dist

from launch import run_workers
from nnscaler.runtime.reducer import Reducer, sync_grad_when


MB = 1024 * 1024


def _p(*shape, dtype=torch.float32, requires_grad=True):
    return torch.nn.Parameter(torch.zeros(*shape, dtype=dtype), requires_grad=requires_grad)


def _ids(buckets):
    return [[id(p) for p in b] for b in buckets]


def test_buckets_reverse_order_cap_and_dtype():
    a, b, big, d = _p(4), _p(4), _p(100), _p(4)  # 16, 16, 400, 16 bytes
    r = Reducer([a, b, big, d], bucket_cap_mb=40 / MB)
    # reverse order; a bucket closes once it reaches the cap (DDP's rule): no tiny leftovers
    assert _ids(r.buckets) == _ids([[d, big], [b, a]])
    r = Reducer([a, b, big, d], bucket_cap_mb=16 / MB)
    assert _ids(r.buckets) == _ids([[d], [big], [b], [a]])  # every param reaches the cap alone
    e = _p(2, dtype=torch.float64)
    frozen = _p(4, requires_grad=False)
    r = Reducer([a, e, b, frozen, a], bucket_cap_mb=1.0)
    assert _ids(r.buckets) == _ids([[b], [e], [a]])  # dtype splits, frozen skipped, duplicates once
    assert Reducer([a, b]).bucket_cap_mb == 25.0 == Reducer([a], bucket_cap_mb=None).bucket_cap_mb


def test_without_group_no_communication():
    w = _p(3)
    r = Reducer([w])
    assert r.group_size == 1
    (w * torch.arange(3.0)).sum().backward()
    assert torch.equal(w.grad, torch.arange(3.0))
    assert r.stats.allreduce_calls == 0


def test_sync_grad_when_nesting():
    r = Reducer([_p(1)])
    assert r.sync_enabled
    with sync_grad_when(False):
        assert not r.sync_enabled
        with sync_grad_when(True):
            assert not r.sync_enabled  # an inner True does not undo an outer False
    with r.sync_grad_when(False):
        assert not r.sync_enabled
    with r.sync_grad_when(True), sync_grad_when(True):
        assert r.sync_enabled
    assert r.sync_enabled


# -- multi-process ------------------------------------------------------------------------------

class _Model(torch.nn.Module):
    """w1, w2 used everywhere; u only on rank 0; z on no rank; f frozen."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w1 = torch.nn.Parameter(torch.randn(4, 4, generator=g))
        self.w2 = torch.nn.Parameter(torch.randn(4, 4, generator=g))
        self.u = torch.nn.Parameter(torch.randn(4, generator=g))
        self.z = torch.nn.Parameter(torch.randn(3, generator=g))
        self.f = torch.nn.Parameter(torch.randn(4, generator=g), requires_grad=False)

    def forward(self, x, rank):
        h = torch.tanh(x @ self.w1) @ self.w2
        out = (h * h).sum() + (self.f * h).sum()
        if rank == 0:
            out = out + (self.u * h).sum()
        return out


def _x(rank, step):
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(100 * step + rank))


def _local_grads(rank, step):
    """Gradients of one rank's loss, computed on a hook-free copy."""
    m = _Model()
    m(_x(rank, step), rank).backward()
    return {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in m.named_parameters()
            if p.requires_grad}


def _mean_grads(world, *steps):
    out = {}
    for r in range(world):
        for s in steps:
            for n, g in _local_grads(r, s).items():
                out[n] = out.get(n, 0) + g / world
    return out


def _close(model, expected):
    return all(torch.allclose(torch.zeros_like(p) if p.grad is None else p.grad, expected[n], atol=1e-6, rtol=1e-6)
               for n, p in model.named_parameters() if p.requires_grad)


class _FailBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("boom in backward")


def _reducer_job(rank, world):
    out = {}
    for async_op in (False, True):
        for cap in (25.0, 1e-9):
            key = (async_op, cap)
            model = _Model()
            r = Reducer(model.parameters(), group=dist.group.WORLD, bucket_cap_mb=cap, async_op=async_op)
            checks = {"buckets": r.num_buckets}
            # 1. one plain backward: mean over ranks; unused params become the mean of what exists
            model(_x(rank, 0), rank).backward()
            checks["plain"] = _close(model, _mean_grads(world, 0))
            checks["calls"] = r.stats.allreduce_calls
            checks["bytes"] = r.stats.allreduce_bytes
            checks["z_none"] = model.z.grad is None  # no rank used it: stays None, as on one device
            checks["u_half"] = torch.allclose(model.u.grad, _local_grads(0, 0)["u"] / 2)
            checks["frozen"] = model.f.grad is None
            # 2. accumulate locally, then one synced backward all-reduces the sum
            model.zero_grad()
            r.stats.reset()
            with sync_grad_when(False):
                model(_x(rank, 1), rank).backward()
            local = _local_grads(rank, 1)
            checks["local_only"] = _close(model, local) and r.stats.allreduce_calls == 0 \
                and r.stats.local_passes == 1
            with sync_grad_when(True):
                model(_x(rank, 2), rank).backward()
            checks["accumulated"] = _close(model, _mean_grads(world, 1, 2)) and r.stats.synced_passes == 1
            # 3. the per-reducer switch, and two synced backward passes in one step
            model.zero_grad()
            with r.sync_grad_when(False):
                model(_x(rank, 1), rank).backward()
            model(_x(rank, 2), rank).backward()
            checks["method"] = _close(model, _mean_grads(world, 1, 2))
            model.zero_grad()
            model(_x(rank, 1), rank).backward()
            model(_x(rank, 2), rank).backward()
            checks["twice"] = _close(model, _mean_grads(world, 1, 2))
            # 4. a backward that raises midway leaves nothing behind; the next one is right
            model.zero_grad()
            try:
                y = _FailBackward.apply(torch.tanh(_x(rank, 0) @ model.w1)) @ model.w2
                (y * y).sum().backward()
            except RuntimeError as e:
                checks["raised"] = "boom" in str(e)
            model.zero_grad()
            model(_x(rank, 0), rank).backward()
            checks["after_abort"] = _close(model, _mean_grads(world, 0))
            r.remove()
            out[key] = checks
    # 5. async launches buckets while backward is still running; a backward that raises after
    #    some launches leaves nothing pending and the next backward is right
    for async_op in (False, True):
        layers = _layers()
        r = Reducer(layers.parameters(), group=dist.group.WORLD, bucket_cap_mb=1e-9, async_op=async_op)
        seen = []
        h = layers[0](_x(rank, 0))
        h.register_hook(lambda g: seen.append(r.stats.allreduce_calls))
        layers[2](layers[1](h)).sum().backward()
        out[("overlap", async_op)] = (seen[0], r.stats.allreduce_calls, r.num_buckets)
        layers.zero_grad()
        try:
            layers[2](layers[1](_FailBackward.apply(layers[0](_x(rank, 0))))).sum().backward()
        except RuntimeError:
            pass
        launched = r.stats.allreduce_calls - 6
        layers.zero_grad()
        layers(_x(rank, 1)).sum().backward()
        expected = [sum(g) / world for g in zip(*(_layer_grads(q, 1) for q in range(world)))]
        ok = all(torch.allclose(p.grad, e, atol=1e-6) for p, e in zip(layers.parameters(), expected))
        out[("abort", async_op)] = (launched, ok)
        r.remove()
    return out


def _layers():
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(3)))


def _layer_grads(rank, step):
    layers = _layers()
    layers(_x(rank, step)).sum().backward()
    return [p.grad for p in layers.parameters()]


@pytest.mark.multiprocess
def test_reducer_two_ranks():
    results = run_workers(_reducer_job, 2)
    for rank, out in enumerate(results):
        for key in [(a, c) for a in (False, True) for c in (25.0, 1e-9)]:
            checks = out[key]
            assert checks["buckets"] == (1 if key[1] == 25.0 else 4), key
            assert checks["calls"] == checks["buckets"], key  # one all-reduce per bucket
            assert checks["bytes"] == 4 * (16 + 16 + 4 + 3 + 4), key  # grads + one flag per param
            for name in ("plain", "z_none", "u_half", "frozen", "local_only", "accumulated", "method", "twice",
                         "raised", "after_abort"):
                assert checks[name] is True, (rank, key, name)
        assert out[("overlap", False)] == (0, 6, 6)
        launched_early, total, buckets = out[("overlap", True)]
        assert launched_early >= 2 and total == buckets == 6
        assert out[("abort", False)] == (0, True)
        assert out[("abort", True)][0] >= 2 and out[("abort", True)][1]


def _no_sync_job(rank, world):
    a, b = _Model(), _Model()
    ra = Reducer(a.parameters(), group=dist.group.WORLD)
    rb = Reducer(b.parameters(), group=dist.group.WORLD)
    out = {}
    # one module's pause leaves the other synchronising
    with ra.no_sync():
        a(_x(rank, 1), rank).backward()
        b(_x(rank, 1), rank).backward()
    out["a_local"] = _close(a, _local_grads(rank, 1)) and ra.stats.allreduce_calls == 0
    out["b_synced"] = _close(b, _mean_grads(world, 1)) and rb.stats.synced_passes == 1
    a(_x(rank, 2), rank).backward()  # a's next synchronising pass averages the accumulated sum
    out["a_accumulated"] = _close(a, _mean_grads(world, 1, 2))
    # the process-wide function pauses both
    a.zero_grad()
    b.zero_grad()
    with sync_grad_when(False):
        a(_x(rank, 1), rank).backward()
        b(_x(rank, 1), rank).backward()
    out["both_local"] = _close(a, _local_grads(rank, 1)) and _close(b, _local_grads(rank, 1))
    out["after"] = ra.sync_enabled and rb.sync_enabled
    ra.remove()
    rb.remove()
    return out


@pytest.mark.multiprocess
def test_no_sync_pauses_one_reducer_only():
    for rank, out in enumerate(run_workers(_no_sync_job, 2)):
        assert out == {"a_local": True, "b_synced": True, "a_accumulated": True, "both_local": True,
                       "after": True}, (rank, out)
