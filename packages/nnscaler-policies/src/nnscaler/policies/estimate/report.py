"""What the estimate says, as one JSON object (``nnscaler plan estimate --json``), as a Trainer
configuration fragment (the plan usable as it is), and as the saved plan file (``--save``).

The mapping of a plan onto nnscaler (`trainer_fragment`):

* ``compute_config``: ``plan_ngpus = tp * pp``, ``runtime_ngpus = tp * pp * dp``,
  ``use_end2end: true``; ``use_zero``: ``False`` (zero 0), ``True`` (zero 1, with
  ``zero_use_reduce_scatter``) or ``3`` (zero 3: fully sharded), and ``zero_ngroups`` when above 1.
* ``pas_policy``: ``dp`` when tp = pp = 1; ``megatron`` (column / row-parallel projections) when
  only tp > 1; ``autodist`` when pp > 1, told the stages (``pipeline_pivots`` = the decoder layer's
  class, ``pipeline_nstages = pp``, ``pipeline_nmicros``) and ``max_partition_degree = tp``, so it
  splits each stage's ops over its tp GPUs itself; ``hybrid`` for an interleaved pipeline
  (``pipeline_scheduler: 1f1b_interleaved``, ``pp_size = pp``, ``pipeline_nstages = pp * virtual``),
  whose stages split their ops over the tp GPUs by batch, not as Megatron's tensor parallelism.
* recomputation: ``pas_config['recompute_modules']`` = the decoder layer's class (every policy reads it).
* ``micro_batch_size``, ``grad_accumulation_steps`` (micro-batches per step) and ``precision``.
* expert parallelism (``ep`` > 1) with tp = 1: ``pas_policy: ep`` (docs/moe.md), ``plan_ngpus = pp * ep``,
  ``runtime_ngpus = pp * dp`` (dp / ep units), and with pp > 1 the pipeline keys (``pp_size``,
  ``pipeline_pivots``, ``pipeline_nstages = pp * virtual``, ``pipeline_nmicros``, the interleaved
  scheduler when virtual > 1). A unit of ep ranks splits one batch over its ranks, so the Trainer's
  data-parallel size is dp / ep and ``micro_batch_size`` is the unit's, ``micro_batch * ep``: the
  Trainer's step takes the plan's dp x micro_batch x nmicros sequences. With tp > 1 it is not mapped:
  the fragment runs the experts replicated over dp (as ep 1, with more memory than estimated);
  ``trainer_note`` says so.
* context parallelism (``cp`` > 1) with tp = 1: ``pas_policy: cp`` (every op split along the sequence,
  ring attention), ``plan_ngpus = cp * pp``, ``runtime_ngpus = cp * pp * dp``, with pp > 1 the same
  pipeline keys; for a mixture-of-experts model ``pas_config['ep_size'] = ep`` (the experts split over
  ep of each stage's cp ranks; 1: replicated). With tp > 1 it is not mapped (the cp policy splits by
  sequence only): the fragment runs cp over tp * cp ranks, the weights not split by tp; ``trainer_note``
  says so.

`sequences_per_step(fragment)` is what the Trainer's step takes under a fragment (its data-parallel
size x micro-batch x accumulation): the plan's ``dp * micro_batch * nmicros``.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from nnscaler.ir import ConfigError, atomic_write

from .cluster import Cluster
from .model import ModelSpec
from .plan_cost import Estimate, Workload
from .search import SearchResult

__all__ = ["FORMAT", "VERSION", "plan_json", "result_json", "trainer_fragment", "save_estimate", "sequences_per_step",
           "use_zero_value"]

FORMAT = "nnscaler-estimate-plan"
VERSION = 1


def plan_json(est: Estimate) -> dict:
    p = est.plan
    return {"tp": p.tp, "cp": p.cp, "pp": p.pp, "dp": p.dp, "ep": p.ep, "zero": p.zero, "zero_ngroups": p.zero_ngroups,
            "micro_batch": p.micro_batch,
            "recompute": p.recompute, "virtual_stages": p.virtual, "nmicros": est.nmicros, "step_s": est.step_s,
            "tokens_per_s": est.tokens_per_s, "tflops_per_gpu": est.tflops_per_gpu, "mfu": est.mfu,
            "memory_gb": est.memory_gb, "fits": est.fits}


def trainer_fragment(est: Estimate, spec: ModelSpec, cluster: Cluster) -> dict:
    """TrainerArgs fields that run this plan (the mapping in this module's docstring)."""
    p = est.plan
    layer = spec.layer_class or "DecoderLayer"
    pas: dict = {}
    plan_ngpus, runtime_ngpus = p.tp * p.pp, p.tp * p.pp * p.dp
    if p.cp > 1 or (p.ep > 1 and p.tp == 1):
        # the cp policy: each stage's ops split along the sequence over its tp * cp devices (tp 1 as planned);
        # the ep policy: each stage's experts over ep devices, dp / ep units
        policy = "cp" if p.cp > 1 else "ep"
        plan_ngpus = p.pp * p.tp * p.cp if p.cp > 1 else p.pp * p.ep
        runtime_ngpus = p.pp * p.tp * p.cp * p.dp if p.cp > 1 else p.pp * p.dp
        if p.cp > 1 and spec.is_moe:
            pas["ep_size"] = p.ep  # the experts over ep of each stage's cp ranks (the cp policy's default: all)
        if p.pp > 1:
            pas.update(pp_size=p.pp, pipeline_pivots=layer, pipeline_nstages=p.pp * p.virtual,
                       pipeline_nmicros=est.nmicros)
            if p.virtual > 1:
                pas["pipeline_scheduler"] = "1f1b_interleaved"
    elif p.pp > 1 and p.virtual > 1:  # interleaved: autodist plans 1F1B only, hybrid runs the interleaved schedule
        policy = "hybrid"
        pas.update(pipeline_pivots=layer, pipeline_nstages=p.pp * p.virtual, pp_size=p.pp,
                   pipeline_nmicros=est.nmicros, pipeline_scheduler="1f1b_interleaved")
    elif p.pp > 1:
        policy = "autodist"
        pas.update(pipeline_pivots=layer, pipeline_nstages=p.pp, pipeline_nmicros=est.nmicros,
                   max_partition_degree=p.tp)
    else:
        policy = "megatron" if p.tp > 1 else "dp"
    if p.recompute:
        pas["recompute_modules"] = layer
    compute = {"plan_ngpus": plan_ngpus, "runtime_ngpus": runtime_ngpus, "use_end2end": True,
               "use_zero": use_zero_value(p.zero), "pas_config": pas}
    if p.zero == 1:
        compute["zero_use_reduce_scatter"] = True
    if p.zero_ngroups > 1:
        compute["zero_ngroups"] = p.zero_ngroups
    # a unit of the ep policy splits its batch over its ep ranks: its micro-batch is ep ranks' worth
    unit_batch = p.micro_batch * (p.ep if policy == "ep" else 1)
    return {"pas_policy": policy, "compute_config": compute, "micro_batch_size": unit_batch,
            "grad_accumulation_steps": est.nmicros, "precision": cluster.gpu.dtype}


def sequences_per_step(fragment: dict) -> int:
    """Sequences a Trainer step takes under `fragment`: the data-parallel size (runtime / plan GPUs) x
    micro_batch_size x grad_accumulation_steps (as TrainerArgs.resolved_global_batch_size)."""
    c = fragment["compute_config"]
    return c["runtime_ngpus"] // c["plan_ngpus"] * fragment["micro_batch_size"] * fragment["grad_accumulation_steps"]


def result_json(result: SearchResult, spec: ModelSpec, cluster: Cluster, work: Workload) -> dict:
    best = result.best
    out = plan_json(best)
    out.update({
        "breakdown_s": {"compute": best.compute_s, "bubble": best.bubble_s, "tp_comm": best.tp_comm_s,
                        "pp_comm": best.pp_comm_s, "dp_comm": best.dp_comm_s, "ep_comm": best.ep_comm_s,
                        "cp_comm": best.cp_comm_s, "optimizer": best.optimizer_s},
        "memory_parts_gb": {k: v / 2 ** 30 for k, v in best.memory_parts.items()},
        "model": {"name": spec.name, "params": spec.total_params, "layers": spec.layers, "hidden": spec.hidden,
                  "heads": spec.heads, "kv_heads": spec.kv_heads, "ffn": spec.ffn, "vocab": spec.vocab,
                  "gated_mlp": spec.gated, "tied_embeddings": spec.tied, "layer_class": spec.layer_class,
                  "active_params": spec.active_params},
        "cluster": cluster.to_json(),
        "gpus": work.gpus, "seq_len": work.seq, "global_batch_tokens": work.global_batch_tokens,
        "model_flops": best.model_flops, "search_s": result.search_s, "plans_evaluated": result.evaluated,
        "runners_up": [dict(plan_json(e), reason=why) for e, why in result.runners_up],
        "trainer": trainer_fragment(best, spec, cluster),
    })
    if spec.is_moe:
        out["moe"] = {"experts": spec.experts, "top_k": spec.top_k, "expert_ffn": spec.expert_ffn,
                      "shared_ffn": spec.shared_ffn, "moe_layers": spec.moe_layers, "total_params": spec.total_params,
                      "active_params": spec.active_params, "imbalance": work.moe_imbalance}
    if best.plan.ep > 1 and best.plan.tp > 1:
        out["trainer_note"] = (f"the fragment does not map expert parallelism with tensor parallelism: it runs the "
                               f"experts replicated over dp (as ep 1), needing more memory than the ep "
                               f"{best.plan.ep} estimate; --ep 1 plans what it runs")
    if best.plan.cp > 1 and best.plan.tp > 1:
        p = best.plan
        out["trainer_note"] = (f"the fragment does not map tensor parallelism with context parallelism (the cp "
                               f"policy splits every op along the sequence only): it runs cp over tp x cp = "
                               f"{p.tp * p.cp} ranks a stage, each holding whole weights, {p.tp} x the weight, "
                               f"gradient and optimizer memory of this estimate; --fix tp=1 plans what it runs")
    elif best.plan.cp > 1 and best.plan.zero:
        opt = best.memory_parts["optimizer"] * (best.plan.cp - 1) / 2 ** 30
        out["trainer_note"] = (f"nnscaler's ZeRO shards the optimizer state over the data-parallel units only: each "
                               f"of the {best.plan.cp} cp ranks keeps 1/dp of it, {opt:.1f} GB a GPU more than this "
                               f"estimate (which shards over dp x cp, as Megatron-LM's distributed optimizer)")
    return out


def use_zero_value(zero: int):
    """ComputeConfig.use_zero for a plan's ZeRO stage: False, True (ZeRO-1) or 3 (fully sharded)."""
    return 3 if zero == 3 else bool(zero)


def save_estimate(path, data: dict) -> None:
    """Write the plan file: `result_json` with its format tag (JSON, nothing executable)."""
    path = Path(os.fspath(path))
    if path.is_dir():
        raise ConfigError(f"--save {path} is a directory; give a file name, e.g. {path / 'plan.json'}")
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, (json.dumps({"format": FORMAT, "version": VERSION, **data}, indent=1) + "\n").encode())
