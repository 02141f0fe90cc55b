"""The matrix's user action "resume on another plan" (issue 45 §1): train 2 steps under plan X, save
(`nnscaler.ckpt.save`, with the optimizer), then, in the same processes, parallelize the model
again under plan Y, load the checkpoint into it (`nnscaler.ckpt.load` reshards model and Adam
state to Y's layout) and train the 3rd step. Parity with one process trained 3 steps without a
break (`matrix_run.reference`), at the bound of the case's precision (`matrix_run.compare`).

The cases (`CASES`) run in one `run_workers` launch per world size, in sequence; X and Y of a
case have the same world size. Plain batches of dense models: the one-process reference is the
same for every data-parallel degree then (a mean over equally many tokens per micro-batch).
"""
from __future__ import annotations

import os
import tempfile
from typing import Dict, List, Sequence

import matrix_run  # noqa: E402  (puts tests/models and tests/runtime on sys.path)
from matrix_cases import PLANS  # noqa: E402

import torch  # noqa: E402

SAVE_AFTER = 2  # steps under plan X; the rest of matrix_run.STEPS under plan Y
# (model, precision, (plan X, zero X), (plan Y, zero Y))
CASES = [
    ("llama", "fp64", ("dp", "3"), ("tp", "none")),
    ("llama", "fp64", ("tp", "none"), ("pp", "1")),
    ("gpt2", "fp64", ("pp", "none"), ("dp", "3")),
    ("qwen2", "fp32", ("megatron", "1"), ("dp", "none")),
    ("llama", "fp64", ("tp x dp", "1"), ("pp x dp", "none")),
]
# The control: the same resume loading the model only (Adam's state starts afresh under Y), which
# must *differ* from the uninterrupted run: the comparison can tell a resume that lost state.
CONTROL = ("gpt2", "fp64", ("tp", "none"), ("dp", "none"))


def _phase(model: str, precision: str, plan: str, zero: str) -> dict:
    """A matrix case dict for one plan of a resume case (what `matrix_run` helpers take)."""
    return {"model": model, "plan": plan, "zero": zero, "recompute": "off", "precision": precision,
            "batch": "plain", "dropout": "off", "action": "none", "zero_ngroups": "1"}


def cases() -> List[dict]:
    """The resume cases, the control last: {id, model, precision, world, control, x: case, y: case}."""
    out = []
    for k, (model, precision, (px, zx), (py, zy)) in enumerate(CASES + [CONTROL]):
        control = k == len(CASES)
        x, y = _phase(model, precision, px, zx), _phase(model, precision, py, zy)
        world = PLANS[px][2]
        assert PLANS[py][2] == world, (px, py)
        cid = f"resume:{model}/{px}/zero={zx} -> {py}/zero={zy}/{precision}" + (" (control: model only)" * control)
        out.append({"id": cid, "model": model, "precision": precision, "world": world, "control": control,
                    "x": dict(x, id=cid + "#x"), "y": dict(y, id=cid)})
    return out


def _parallel(rank, world, case, root, name):
    from nnscaler import ComputeConfig, build_optimizer, parallelize
    policy, kwargs = matrix_run.compute_config(case, world)
    n = matrix_run.nmicros(case)
    per = matrix_run.GLOBAL_BATCH // (world // kwargs["plan_ngpus"])
    sample = {k: v[:per // n] for k, v in matrix_run._batch(case, 0).items()}
    pm = parallelize(matrix_run.make_model(case), sample, policy, ComputeConfig(**kwargs),
                     gen_savedir=os.path.join(root, name), instance_name=name)
    opt = build_optimizer(pm, torch.optim.Adam, lr=matrix_run.LR, eps=matrix_run.EPS[case["precision"]])
    return pm, opt, kwargs


def _step(rank, world, case, pm, opt, kwargs, step) -> float:
    """One training step of `case` on this rank; the global batch's loss (the same on every rank)."""
    import torch.distributed as dist
    dp = world // kwargs["plan_ngpus"]
    per, n = matrix_run.GLOBAL_BATCH // dp, matrix_run.nmicros(case)
    full = matrix_run._batch(case, step)
    dp_rank = rank // kwargs["plan_ngpus"]
    mine = {k: v[dp_rank * per:(dp_rank + 1) * per] for k, v in full.items()}
    opt.zero_grad()
    if kwargs.get("use_end2end", False):
        outputs = pm.train_step(matrix_run._micros(mine, n))
        opt.scale_grads(1.0 / n)
        loss = torch.stack([o.detach().double().reshape(()) for o in outputs]).mean()
    else:
        loss = pm(**mine)
        loss.backward()
        loss = loss.detach().double()
    opt.step()
    t = loss.reshape(1).clone()
    dist.all_reduce(t)
    return t.item() / world


def run_rank_resume(rank: int, world: int, todo: Sequence[dict], root: str) -> List[dict]:
    """Every resume case of `todo` on this rank: {"state": "ok", losses, shards, reads}."""
    import gc

    import torch.distributed as dist
    from nnscaler.ckpt import load, save
    out = []
    for i, case in enumerate(todo):
        where = os.path.join(root, f"resume{i}")
        pm, opt, kwargs = _parallel(rank, world, case["x"], where, "x")
        losses = [_step(rank, world, case["x"], pm, opt, kwargs, s) for s in range(SAVE_AFTER)]
        save(os.path.join(where, "ckpt"), pm, opt)
        del pm, opt
        gc.collect()
        pm, opt, kwargs = _parallel(rank, world, case["y"], where, "y")
        load(os.path.join(where, "ckpt"), pm, None if case["control"] else opt)
        losses += [_step(rank, world, case["y"], pm, opt, kwargs, s) for s in range(SAVE_AFTER, matrix_run.STEPS)]
        with pm.unsharded():
            shards = [(e.full_name, tuple(e.full_shape), tuple(e.slices), getattr(pm, local).detach().clone())
                      for local, e in pm.fullmap.items() if isinstance(getattr(pm, local), torch.nn.Parameter)]
        out.append({"state": "ok", "losses": losses, "shards": shards, "reads": {}})
        del pm, opt
        gc.collect()
        dist.barrier()
    return out


def run_resume(todo: Sequence[dict] = None) -> Dict[str, dict]:
    """Run the resume cases (all of `cases()` by default), one launch per world size; {id: record}
    with state parity / differs (the control's expected state), or crash for every case of a
    launch that failed (its error)."""
    from launch import WorkerError, run_workers
    todo = cases() if todo is None else list(todo)
    records: Dict[str, dict] = {}
    for world in sorted({c["world"] for c in todo}):
        mine = [c for c in todo if c["world"] == world]
        with tempfile.TemporaryDirectory(prefix="nnscaler-matrix-resume-") as root:
            try:
                results = run_workers(run_rank_resume, world, mine, root,
                                      timeout=matrix_run.DEADLINE[world] * len(mine))
            except WorkerError as exc:
                for c in mine:
                    records[c["id"]] = {"state": "crash", "error": matrix_run._first_error(str(exc))}
                continue
        for i, c in enumerate(mine):
            diff = matrix_run.compare(c["y"], [r[i] for r in results], matrix_run.reference(c["y"]))
            records[c["id"]] = {"state": "differs", "error": diff} if diff else {"state": "parity"}
    return records
