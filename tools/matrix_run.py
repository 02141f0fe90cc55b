"""Run one matrix case (issue 45 §1): train 3 Adam steps through `parallelize` + `build_optimizer` on
real gloo processes (`tests/runtime/launch.run_workers`, forked from the fork server) and compare
with one process trained on the same global batch.

A case ends in one state:
* ``parity``: every loss and every parameter (assembled from the ranks' pieces; ranks holding
  the same piece must agree exactly) within the precision's bound: float64 1e-9 (absolute, losses
  relative to max(1, |loss|)), float32 1e-5 (per-tensor ||a-b|| / max(||b||, 1): a tensor that
  stays near 0, as a key bias whose exact gradient is 0, is held to an absolute bound; losses
  relative), bf16
  parameters with fp32 masters 1e-2 (per-tensor relative; bf16 rounds each update to 8 bits, so
  a plan that sums in another order differs by about 4e-3: our bound, not the issue's);
* ``refused``: `parallelize` or `build_optimizer` raised one of nnscaler's errors (ConfigError,
  GenerationError, PlanError, ...: they name the culprit and the alternative; a TraceError is a
  crash) on a rank before training;
* ``crash`` (any other exception, its first line), ``hang`` (past the deadline: every rank's
  Python stacks, dumped by faulthandler just before the deadline, are attached) or ``differs``
  (the first value out of bounds): failures, recorded as found.

For a model with an auxiliary load-balancing loss (`hf_models.MoeCausalLM`: Mixtral, Qwen3-MoE,
gpt-oss) the reference takes that loss per data-parallel replica's micro-batch and averages them
(docs/moe.md's semantics, as `tests/models/test_moe_parity.py`'s per-replica reference); see
`_per_replica_loss`.

The model "llama" is HF Llama with RMSNorm in the input's dtype (`hf_models.llama64`: HF computes
it in float32 whatever the model's dtype); the vision model is transformers' ViT (timm imports
torchvision, whose only build for torch 2.13 here is a CUDA one that fails to import beside the CPU
torch).
"""
from __future__ import annotations

import faulthandler
import os
import sys
import tempfile
import time
from typing import Any, Dict, List

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (os.path.join(_ROOT, "tests", "models"), os.path.join(_ROOT, "tests", "runtime"), os.path.dirname(__file__)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402

import hf_models  # noqa: E402
from matrix_cases import PLANS  # noqa: E402

STEPS = 3
GLOBAL_BATCH = 8
NMICROS = 2  # pipeline micro-batches per step (times 2 with action=accum)
LR = 1e-3
CLIP = 0.05
SEED = 1234
DROPOUT = 0.1
TOL = {"fp64": 1e-9, "fp32": 1e-5, "bf16": 3e-2}
# Adam's eps by precision: a gradient that is zero in exact arithmetic (GPT-2's key bias: softmax ignores a
# constant added to every key) is rounding noise in float32 / bf16, which eps=1e-8 turns into a full
# +-lr step whose sign depends on the summation order; a larger eps keeps such noise at noise size.
EPS = {"fp64": 1e-8, "fp32": 1e-4, "bf16": 1e-3}
DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16}
LAYERS = {"llama": "LlamaDecoderLayer", "qwen2": "Qwen2DecoderLayer", "mistral": "MistralDecoderLayer",
          "gpt2": "GPT2Block", "bert": "BertLayer", "mixtral": "MixtralDecoderLayer",
          "qwen3_moe": "Qwen3MoeDecoderLayer", "deepseek_v3": "DeepseekV3DecoderLayer",
          "gpt_oss": "GptOssDecoderLayer", "vit": "ViTLayer"}
COMM = {"backend": "given", "collectives": {c: {"2": [1e-5, 5e9], "4": [2e-5, 5e9]}
                                            for c in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")}}
DEADLINE = {2: 150, 4: 300}  # seconds a case may take, by world size


def builder_name(case) -> str:
    name = "llama64" if case["model"] == "llama" else case["model"]
    return f"{name}_packed" if case["batch"] == "packed" else name


def _pad(case):
    return case["batch"] in ("padded", "packed")


def make_model(case):
    model = hf_models.make(builder_name(case), DTYPES[case["precision"]])
    if case["dropout"] == "exact":
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = DROPOUT
            if hasattr(module, "attention_dropout") and isinstance(module.attention_dropout, float):
                module.attention_dropout = DROPOUT
    return model


def compute_config(case, world):
    """(policy, ComputeConfig kwargs) of a case."""
    policy, plan_ngpus, _, extra = PLANS[case["plan"]]
    extra = dict(extra)
    pas = dict(extra.pop("pas_config", {}))
    if pas.get("pipeline_pivots") == "<layer>":
        pas["pipeline_pivots"] = LAYERS[case["model"]]
    if pas.get("_comm_profile") == "<given>":
        pas["_comm_profile"] = COMM
    if extra.get("use_end2end"):
        pas["pipeline_nmicros"] = nmicros(case)
    if case["recompute"] == "layers":
        pas["recompute_modules"] = LAYERS[case["model"]]
    cfg = dict(plan_ngpus=plan_ngpus, runtime_ngpus=world, trace_strategy="cpu", pas_config=pas, **extra)
    if case["zero"] != "none":
        cfg["use_zero"] = 3 if case["zero"] == "3" else True
        cfg["zero_ngroups"] = int(case["zero_ngroups"])
    if case["dropout"] == "exact":
        cfg["rng_mode"] = "exact"
    return policy, cfg


def nmicros(case) -> int:
    """Forward calls per step on a rank: 2 under a pipeline, times 2 with gradient accumulation."""
    end2end = PLANS[case["plan"]][3].get("use_end2end", False)
    return (NMICROS if end2end else 1) * (2 if case["action"] == "accum" else 1)


def _micros(batch, n):
    size = len(next(iter(batch.values()))) // n
    return [{k: v[i * size:(i + 1) * size] for k, v in batch.items()} for i in range(n)]


def _batch(case, step):
    return hf_models.batch(builder_name(case), step, GLOBAL_BATCH, DTYPES[case["precision"]], _pad(case))


# -- the ranks ------------------------------------------------------------------------------------

def run_rank(rank, world, case, root):
    """One rank of `case`: {"state": "ok", losses, shards, reads} or {"state": "refused", error}."""
    deadline = DEADLINE[world]
    stacks = open(os.path.join(root, f"stacks.{rank}.txt"), "w")
    faulthandler.dump_traceback_later(deadline - 8, exit=False, file=stacks)
    try:
        return _train(rank, world, case, root)
    finally:
        faulthandler.cancel_dump_traceback_later()
        stacks.close()


def _train(rank, world, case, root):
    import torch.distributed as dist
    from nnscaler import ComputeConfig, build_optimizer, parallelize
    from nnscaler.ir import NnScalerError, TraceError
    from nnscaler.runtime import with_master_weights

    policy, kwargs = compute_config(case, world)
    plan_ngpus = kwargs["plan_ngpus"]
    dp, dp_rank = world // plan_ngpus, rank // plan_ngpus
    per, n = GLOBAL_BATCH // dp, nmicros(case)
    end2end = kwargs.get("use_end2end", False)
    try:
        cfg = ComputeConfig(**kwargs)
        trace_n = per // n
        sample = {k: v[:trace_n] for k, v in _batch(case, 0).items()}
        pm = parallelize(make_model(case), sample, policy, cfg, gen_savedir=os.path.join(root, "gen"),
                         instance_name="m")
        opt = build_optimizer(pm, torch.optim.Adam, lr=LR, eps=EPS[case["precision"]])
        if case["precision"] == "bf16":
            opt = with_master_weights(opt)
    except NnScalerError as exc:
        if isinstance(exc, TraceError):  # a model nnscaler cannot trace is a failure, not a refusal
            raise
        return {"state": "refused", "error": f"{type(exc).__name__}: {exc}"}
    if case["dropout"] == "exact":
        pm.manual_seed(SEED)
    reads = [e.full_name for local, e in pm.fullmap.items() if isinstance(getattr(pm, local), torch.nn.Parameter)][:2]
    losses, read = [], {}
    for step in range(STEPS):
        full = _batch(case, step)
        mine = {k: v[dp_rank * per:(dp_rank + 1) * per] for k, v in full.items()}
        opt.zero_grad()
        if end2end:
            outputs = pm.train_step(_micros(mine, n))
            opt.scale_grads(1.0 / n)
            loss = torch.stack([o.detach().double().reshape(()) for o in outputs]).mean()
        else:
            total = 0.0
            for mb in _micros(mine, n):
                part = pm(**mb)
                part.backward()
                total = total + part.detach().double()
            if n > 1:
                opt.scale_grads(1.0 / n)
            loss = total / n
        if case["action"] == "read":
            [_read(pm, name).double().norm() for name in reads]
        if case["action"] == "clip":
            opt.clip_gnorm(CLIP)
        opt.step()
        if case["action"] == "read":
            read = {name: _read(pm, name).detach().clone() for name in reads}
        if case["action"] == "save_load" and step == 1:
            _save_perturb_load(pm, opt, os.path.join(root, "ckpt"))
        t = loss.detach().double().reshape(1).clone()
        dist.all_reduce(t)
        losses.append(t.item() / world)
    with pm.unsharded():
        shards = [(e.full_name, tuple(e.full_shape), tuple(e.slices), getattr(pm, local).detach().clone())
                  for local, e in pm.fullmap.items() if isinstance(getattr(pm, local), torch.nn.Parameter)]
    return {"state": "ok", "losses": losses, "shards": shards, "reads": read}


def _read(pm, full_name):
    local = next(name for name, e in pm.fullmap.items() if e.full_name == full_name)
    return getattr(pm, local)


def _save_perturb_load(pm, opt, path):
    """Save, spoil every local parameter, load back: training must go on as if nothing happened."""
    from nnscaler.ckpt import load, save
    save(path, pm, opt)
    with torch.no_grad():
        for p in pm.parameters():
            p.add_(1.0)
    load(path, pm, opt)


# -- one process ----------------------------------------------------------------------------------

def reference(case) -> Dict[str, Any]:
    """One process on the global batch, micro-batch i of a step being the ranks' i-th micro-batches
    together (what a data-parallel step of that many micro-batches computes)."""
    from nnscaler.runtime import with_master_weights
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers
    try:
        model = make_model(case)
        opt = torch.optim.Adam(model.parameters(), lr=LR, eps=EPS[case["precision"]])
        if case["precision"] == "bf16":
            opt = with_master_weights(opt)
        if case["dropout"] == "exact":
            torch.manual_seed(SEED)
        world = PLANS[case["plan"]][2]
        dp = world // PLANS[case["plan"]][1]
        n, per = nmicros(case), GLOBAL_BATCH // dp
        aux = isinstance(model, hf_models.MoeCausalLM) and dp > 1
        losses = []
        for step in range(STEPS):
            ranks = [{k: v[r * per:(r + 1) * per] for k, v in _batch(case, step).items()} for r in range(dp)]
            pieces = [_micros(r, n) for r in ranks]
            opt.zero_grad()
            total = 0.0
            for i in range(n):
                mb = {k: torch.cat([p[i][k] for p in pieces]) for k in pieces[0][i]}
                part = _per_replica_loss(model, mb, dp) if aux else model(**mb)
                (part / n).backward()
                total += float(part.detach())
            if case["action"] == "clip":
                if hasattr(opt, "clip_gnorm"):
                    opt.clip_gnorm(CLIP)
                else:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            losses.append(total / n)
        return {"losses": losses, "params": {k: v.detach().clone() for k, v in model.named_parameters()}}
    finally:
        torch.set_num_threads(threads)


def _per_replica_loss(model, mb, dp):
    """`model(**mb)` with the router's load-balancing loss taken per data-parallel replica (`dp`
    equal row groups of `mb`, each a replica's micro-batch) and averaged, as nnscaler, Megatron and
    DeepSpeed compute it (docs/moe.md; `tests/models/test_moe_parity.py`'s per-replica reference).
    One forward on the whole micro-batch, so dropout draws as for it; the next-token loss, a mean
    over equally many tokens per replica, is unchanged."""
    captured = []
    hook = model.model.register_forward_hook(lambda _m, _i, out: captured.append(out.router_logits))
    try:
        whole = model(**mb)
    finally:
        hook.remove()
    cfg = model.model.config
    experts, k = getattr(cfg, "num_local_experts", None) or cfg.num_experts, cfg.num_experts_per_tok
    layers = [logits.reshape(dp, -1, logits.shape[-1]) for logits in captured[0]]  # rows are batch-major
    per_replica = torch.stack([hf_models.load_balancing_loss([lg[r] for lg in layers], experts, k)
                               for r in range(dp)]).mean()
    global_aux = hf_models.load_balancing_loss(captured[0], experts, k)
    return whole + cfg.router_aux_loss_coef * (per_replica - global_aux)


def compare(case, results: List[dict], ref: Dict[str, Any]) -> str:
    """'' when every rank's result is within the case's bound of `ref`, else the first difference."""
    from parity import assemble_full
    tol = TOL[case["precision"]]
    for step, (got, want) in enumerate(zip(results[0]["losses"], ref["losses"])):
        if not abs(got - want) <= tol * max(1.0, abs(want)):
            return f"loss of step {step}: {got!r} vs {want!r} (bound {tol})"
    try:
        params = assemble_full(((r, res["shards"]) for r, res in enumerate(results)), case["id"])
    except AssertionError as exc:
        return str(exc).splitlines()[0]
    if set(params) != set(ref["params"]):
        return f"parameter names differ: {sorted(set(params) ^ set(ref['params']))[:4]}"
    for name, value in params.items():
        value, want = value.double(), ref["params"][name].double()
        if torch.isnan(value).any():
            return f"parts of {name} are held by no rank"
        diff = _diff(case, value, want)
        if not diff <= tol:
            return f"{name} differs by {diff:.3g} (bound {tol})"
    for r, res in enumerate(results):
        for name, value in res["reads"].items():
            if tuple(value.shape) == tuple(ref["params"][name].shape):
                diff = _diff(case, value.double(), ref["params"][name].double())
                if not diff <= tol:
                    return f"rank {r} read {name} outside forward, off by {diff:.3g}"
    return ""


def _diff(case, value, want):
    if case["precision"] == "fp64":
        return (value - want).abs().max().item()
    return ((value - want).norm() / want.norm().clamp_min(1.0)).item()


def run_case(case) -> Dict[str, Any]:
    """Run `case` on its world of gloo processes; its record for matrix.json (state, seconds,
    error's first line, details)."""
    from launch import WorkerError, run_workers
    world = PLANS[case["plan"]][2]
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="nnscaler-matrix-") as root:
        try:
            results = run_workers(run_rank, world, case, root, timeout=DEADLINE[world])
        except WorkerError as exc:
            text = str(exc)
            hang = "timed out after" in text
            record = {"state": "hang" if hang else "crash", "error": _first_error(text)}
            if hang:
                record["stacks"] = _stacks(root, world)
            else:
                record["details"] = text[-4000:]
            return dict(record, seconds=round(time.monotonic() - start, 1))
        refused = [r["error"] for r in results if r["state"] == "refused"]
        if refused:
            record = {"state": "refused", "error": refused[0].splitlines()[0]}
        else:
            try:
                diff = compare(case, results, reference(case))
            except Exception as exc:  # noqa: BLE001 - the reference itself failed: recorded
                diff = f"reference failed: {type(exc).__name__}: {exc}".splitlines()[0]
            record = {"state": "differs", "error": diff} if diff else {"state": "parity"}
    return dict(record, seconds=round(time.monotonic() - start, 1))


def _first_error(text: str) -> str:
    """The exception line of the first traceback in a WorkerError's text."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    for i, line in enumerate(lines):
        if line.startswith("Traceback"):
            for later in lines[i + 1:]:
                if not later.startswith((" ", "Traceback", "---")):
                    return later.strip()[:300]
    return lines[0][:300] if lines else "unknown failure"


def _stacks(root, world) -> Dict[str, str]:
    out = {}
    for r in range(world):
        try:
            with open(os.path.join(root, f"stacks.{r}.txt")) as f:
                out[str(r)] = f.read()[-3000:]
        except OSError:
            out[str(r)] = "(no stack file)"
    return out
