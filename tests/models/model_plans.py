"""What the model tier runs on every rank: several plans per model in one spawn of worker
processes, each with its own gen_savedir; the parent compares with `reference`."""
from __future__ import annotations

import os

import torch

import hf_models

STEPS = 3
GLOBAL_BATCH = 4
NMICROS = 2
LR = 1e-3


def plan(label, policy, plan_ngpus, *, train=True, pad=False, reads=False, **cfg):
    """One plan of a model: `cfg` goes to ComputeConfig (pas_config included). With `train`
    False the model trains in eval mode (BatchNorm uses its running statistics); with `reads`
    parameters are read outside forward every step (`READS`)."""
    label = label if train else f"{label}-eval"
    return dict(label=label, policy=policy, plan=plan_ngpus, train=train, pad=pad, reads=reads, cfg=cfg)


def dp(**kw):
    return plan("dp", "dp", 1, **kw)


def zero(**kw):
    return plan("dp-zero", "dp", 1, use_zero=True, **kw)


def zero3(**kw):
    return plan("dp-zero3", "dp", 1, use_zero=3, **kw)


# Under use_zero=3 (plans with reads=True) every step reads parameters outside forward, as a user
# logging a weight norm would: a block's and the root's between backward and step, then again
# after the step (whole on every rank under tp too); the values read after the last step are checked.
READS = {"llama": (("model.model.layers.0.self_attn.q_proj.weight", "model.model.norm.weight"),
                   ("model.model.layers.0.input_layernorm.weight", "model.model.norm.weight"))}


def _read(pm, full_name):
    local = next(name for name, e in pm.fullmap.items() if e.full_name == full_name)
    return getattr(pm, local)


def tp(**kw):
    return plan("tp", "tp", 2, **kw)


def megatron(**kw):
    return plan("megatron", "megatron", 2, **kw)


def pp(**kw):
    return plan("pp", "pp", 2, use_end2end=True,
                pas_config={"pipeline_nmicros": NMICROS, "pipeline_scheduler": "1f1b"}, **kw)


def _micro(batch, n):
    size = len(next(iter(batch.values()))) // n
    return [{k: v[i * size:(i + 1) * size] for k, v in batch.items()} for i in range(n)]


def _pad_at(pad, step):
    """`pad` is one flag for every step, or one per step."""
    return pad[step] if isinstance(pad, (list, tuple)) else pad


BIAS = "e_score_correction_bias"  # DeepSeek-V3's router bias: compared as the parameters are


def reference(name, train=True, pad=False, dtype=torch.float64, halves=False, balance=None):
    """Single-process Adam training on the global batch: (losses, parameters and router biases).
    With `halves`, each step's gradient is accumulated over the two halves of the batch (each loss /
    2) instead. With `balance` (a coefficient), DeepSeek-V3's auxiliary-loss-free balancing written
    out here: after each step every router's bias += balance * sign(mean load - load), the load
    being the step's tokens per expert (counted from the router's top-k)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers: float32 islands (HF softmax / RMSNorm) round per thread split
    try:
        return _reference(name, train, pad, dtype, halves, balance)
    finally:
        torch.set_num_threads(threads)


def _count_routes(model, loads):
    """Forward hooks adding each router's top-k counts of a forward into `loads` (router -> counts)."""
    def hook(router, _inputs, out):
        loads[router] = loads.get(router, 0) + torch.bincount(out[2].reshape(-1), minlength=router.num_experts).double()
    for module in model.modules():
        if hasattr(module, BIAS):
            module.register_forward_hook(hook)


def _reference(name, train, pad, dtype, halves, balance):
    model = hf_models.make(name, dtype, train)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    loads = {}
    if balance is not None:
        _count_routes(model, loads)
    losses = []
    for step in range(STEPS):
        batch = hf_models.batch(name, step, GLOBAL_BATCH, dtype, _pad_at(pad, step))
        opt.zero_grad()
        if halves:
            loss = 0.0
            for mb in _micro(batch, 2):
                half = model(**mb) / 2
                half.backward()
                loss += float(half.detach())
        else:
            loss = model(**batch)
            loss.backward()
        opt.step()
        with torch.no_grad():
            for router, load in loads.items():
                getattr(router, BIAS).add_(balance * torch.sign(load.mean() - load))
        loads.clear()
        losses.append(float(loss.detach()) if torch.is_tensor(loss) else loss)
    state = dict(model.named_parameters())
    state.update((k, v) for k, v in model.named_buffers() if k.endswith(BIAS))
    return losses, {k: v.detach().clone() for k, v in state.items()}


def train_plan(rank, world, name, case, gen_root):
    """Train `name` under `case` for STEPS Adam steps; (mean loss per step, this rank's parameter
    shards as (full name, full shape, slices, value)). Under use_zero=3 the weights are read from a
    saved and merged checkpoint instead (every tensor whole, on every rank)."""
    import torch.distributed as dist
    from nnscaler import ComputeConfig, build_optimizer, parallelize
    from nnscaler.runtime import GuardError

    dp_size, dp_rank = world // case["plan"], rank // case["plan"]
    per = GLOBAL_BATCH // dp_size
    cfg = ComputeConfig(case["plan"], world, trace_strategy="cpu", **case["cfg"])
    end2end = cfg.use_end2end
    sample = hf_models.batch(name, 0, per // NMICROS if end2end else per, pad=case.get("trace_pad", case["pad"]))
    pm = parallelize(hf_models.make(name, train=case["train"]), sample, case["policy"], cfg,
                     gen_savedir=os.path.join(gen_root, case["label"]),
                     instance_name=f"{name}_{case['label']}".replace("-", "_"))
    pm.train(case["train"])
    opt = build_optimizer(pm, torch.optim.Adam, lr=LR)
    if case.get("balance") is not None:  # DeepSeek-V3's auxiliary-loss-free balancing
        from nnscaler.runtime.moe import balance_experts
        assert balance_experts(pm, case["balance"]), "no router bias to balance"
    losses, reads = [], case.get("reads") and READS[name]
    for step in range(STEPS):
        full = hf_models.batch(name, step, GLOBAL_BATCH, pad=_pad_at(case["pad"], step))
        mine = {k: v[dp_rank * per:(dp_rank + 1) * per] for k, v in full.items()}
        opt.zero_grad()
        try:
            if end2end:
                outputs = pm.train_step(_micro(mine, NMICROS))
                opt.scale_grads(1.0 / NMICROS)
                loss = torch.stack([o.detach().reshape(()) for o in outputs]).mean()
            else:
                loss = pm(**mine)
                loss.backward()
                if reads:  # outside forward, between backward and step
                    [_read(pm, n).norm() for n in reads[0]]
        except GuardError as exc:
            if not case.get("guard_ok"):
                raise
            losses.append(("GuardError", str(exc)))  # the parent checks every rank said so
            break
        opt.step()
        if reads:  # outside forward, after the step
            [_read(pm, n).norm() for n in reads[1]]
        t = loss.detach().reshape(1).clone()
        dist.all_reduce(t)
        losses.append(t.item() / world)
    if cfg.zero_stage == 3:  # the shards hold the values: every registered parameter is empty between steps
        assert pm.fully_sharded is not None and all(p.numel() == 0 for p in pm.parameters()), case["label"]
        assert pm.fully_sharded.stats.reduce_scatters > 0 and pm.fully_sharded.groups.size == dp_size // cfg.zero_ngroups
        read = {n: _read(pm, n).detach().clone() for n in reads[1]} if reads else {}
        stats = dict(vars(pm.fully_sharded.stats))  # what was gathered when (Zero3Stats)
        return losses, _merged_weights(pm, opt, os.path.join(gen_root, case["label"], "ckpt")), read, stats
    with pm.unsharded():  # whole local tensors (use_zero=3 gathers them)
        shards = [(e.full_name, e.full_shape, e.slices, getattr(pm, local).detach().clone())
                  for local, e in pm.fullmap.items()
                  if isinstance(getattr(pm, local), torch.nn.Parameter) or e.full_name.endswith(BIAS)]
    return losses, shards


def _merged_weights(pm, opt, path):
    """The weights as a saved and merged checkpoint holds them: (full name, full shape, whole
    slices, value) of every tensor of the merged model file (the same on every rank)."""
    import torch.distributed as dist
    from safetensors.torch import load_file
    from nnscaler.ckpt import merge, save
    os.makedirs(path, exist_ok=True)
    save(os.path.join(path, "sharded"), pm, opt)
    if dist.get_rank() == 0:
        merge(os.path.join(path, "sharded"), os.path.join(path, "merged"), model_only=True)
    dist.barrier()
    weights = load_file(os.path.join(path, "merged", "model.safetensors"))
    out = []
    for local, _ in pm.named_parameters():  # a tied weight is merged once, under one of its names
        name = pm.fullmap[local].full_name
        stored = [n for n in (name, *(a for a, loc in pm.full_aliases.items() if loc == local)) if n in weights]
        assert stored, f"{name} is not in the merged checkpoint"
        v = weights[stored[0]]
        out.append((name, tuple(v.shape), tuple((0, d) for d in v.shape), v))
    for local, _ in pm.named_buffers():  # router biases that balancing moves (DeepSeek-V3): checkpointed too
        if local in pm.fullmap and pm.fullmap[local].full_name.endswith(BIAS):
            v = weights[pm.fullmap[local].full_name]
            out.append((pm.fullmap[local].full_name, tuple(v.shape), tuple((0, d) for d in v.shape), v))
    return out


def run_plans(rank, world, cases, gen_root):
    """Every case (a `plan` with its "model") in this one spawn; results by label."""
    return {case["label"]: train_plan(rank, world, case["model"], case, gen_root) for case in cases}
