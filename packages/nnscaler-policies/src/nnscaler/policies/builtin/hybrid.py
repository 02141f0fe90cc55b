"""`pp` and `hybrid`: pipeline parallelism (+ tensor parallelism on dim 0) inside a unit, data
parallelism across units.

``hybrid`` keys (``pas_config``):

* ``pipeline_nstages``: ``"auto"`` (default) or an int. ``"auto"`` with ``pipeline_pivots``
  pipelines with ``pp_size`` stages when given, else with as many stages as the pivots allow
  up to ``plan_ngpus`` (the largest divisor of ``plan_ngpus`` not above one more than the number
  of pivot modules that start after the first op); ``"auto"`` without pivots does not pipeline.
  ``1``: no pipeline (``pipeline_pivots`` must not be set). ``> 1``: pipeline with that many
  stages (``pipeline_pivots`` must be set).
* ``pipeline_nmicros`` (required): micro-batches per step; ``train_step`` takes that many.
* ``pipeline_scheduler``: ``1f1b`` (default; ``infer_pipe`` when ``inference_only``),
  ``1f1b_plus``, ``1f1b_interleaved``, ``gpipe``, ``chimera_direct``, ``infer_pipe``.
* ``pp_size``: pipeline devices; default ``pipeline_nstages``. Must divide ``pipeline_nstages``
  (more stages than pipeline devices: ``1f1b_interleaved``) and ``plan_ngpus``; each pipeline
  device has ``tp_size = plan_ngpus // pp_size`` plan devices over which every op of its stages
  is split on the dim of its first input's axis 0 (replicated where that does not split).
* ``pipeline_pivots``: comma-separated module class names or module-path globs; stages start
  only where such a module starts, balanced by op weight (`op_weight`).

``pp``: ``hybrid`` with ``tp_size = 1``: ``pipeline_nstages`` defaults to ``plan_ngpus``
(``2 * plan_ngpus`` for ``1f1b_interleaved``), ``pp_size`` is ``plan_ngpus``, and
``pipeline_pivots`` is optional (without it, stages are cut at any op boundary, balanced by op
count). Both need ``use_end2end=True``.
"""
from __future__ import annotations

from nnscaler.ir import ConfigError
from nnscaler.ir.schedules import INFERENCE_SCHEDULES, SCHEDULES, TRAINING_SCHEDULES

from ..pipeline import cut_stages, pivot_leads, schedule
from ..registry import COMMON_KEYS as EVERY_POLICY_KEYS, register_policy
from ._spread import split_batch_or_replicate

COMMON_KEYS = {"pipeline_nmicros", "pipeline_scheduler", "pipeline_nstages", "pipeline_pivots", "pp_size",
               "recompute_modules"}


def _int(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"pas_config[{name!r}] must be an integer >= {minimum}, got {value!r}")
    return value


def _check_keys(policy: str, pas: dict) -> None:
    known = COMMON_KEYS | EVERY_POLICY_KEYS  # and what every plan reads (use_zero=3's units, resharding, precision)
    unknown = sorted(k for k in pas if not str(k).startswith("_") and k not in known)
    if unknown:
        raise ConfigError(f"pas_policy {policy!r} does not know pas_config key(s) {', '.join(map(repr, unknown))}; "
                          f"its keys are {', '.join(sorted(known))} (prefix your own keys with '_')")


def _scheduler(policy: str, cfg, pas: dict) -> str:
    inference = cfg.inference_only
    name = pas.get("pipeline_scheduler", "infer_pipe" if inference else "1f1b")
    if not isinstance(name, str) or name not in SCHEDULES:
        raise ConfigError(f"pas_config['pipeline_scheduler'] = {name!r} is not a schedule; training: "
                          f"{', '.join(sorted(TRAINING_SCHEDULES))}; inference: {', '.join(sorted(INFERENCE_SCHEDULES))}")
    if name in INFERENCE_SCHEDULES and not inference:
        raise ConfigError(f"pas_config['pipeline_scheduler'] = {name!r} runs forwards only, but the module is built "
                          f"for training (inference_only=False): use a training schedule "
                          f"({', '.join(sorted(TRAINING_SCHEDULES))}) or set inference_only=True")
    return name


def _common(policy: str, cfg):
    if not cfg.use_end2end:
        raise ConfigError(f"pas_policy {policy!r} pipelines the whole model and needs ComputeConfig(use_end2end=True) "
                          f"(train_step / infer_step run the micro-batches); with parallel_modules or a plain "
                          f"forward use 'tp', 'data' or 'dp'")
    pas = dict(cfg.pas_config or {})
    _check_keys(policy, pas)
    if "pipeline_nmicros" not in pas:
        raise ConfigError(f"pas_policy {policy!r} needs pas_config['pipeline_nmicros'] (micro-batches per step)")
    nmicros = _int("pipeline_nmicros", pas["pipeline_nmicros"])
    return pas, nmicros, _scheduler(policy, cfg, pas)


def _place(graph, ngpus: int, tp_size: int) -> None:
    """Every op split on dim 0 (or replicated) over its stage's devices, or the whole unit."""
    for node in graph.nodes:
        devices = (graph.pipeline.home_devices(node.stage) if graph.pipeline is not None
                   else tuple(range(ngpus)))
        split_batch_or_replicate(graph, node, devices)


def _pipeline(graph, cfg, nstages: int, pp_size: int, nmicros: int, scheduler: str, leads) -> None:
    ngpus = cfg.plan_ngpus
    if nstages % pp_size:
        raise ConfigError(f"pas_config['pipeline_nstages'] ({nstages}) must be a multiple of pp_size ({pp_size}): "
                          f"every pipeline device holds the same number of stages")
    if ngpus % pp_size:
        raise ConfigError(f"plan_ngpus ({ngpus}) must be a multiple of pp_size ({pp_size}): each pipeline device "
                          f"gets plan_ngpus // pp_size devices for tensor parallelism")
    if nstages > pp_size and scheduler != "1f1b_interleaved":
        raise ConfigError(f"pipeline_nstages ({nstages}) > pp_size ({pp_size}) puts several stages on a device, "
                          f"which only pipeline_scheduler='1f1b_interleaved' runs; got {scheduler!r}")
    if scheduler == "1f1b_interleaved" and nstages == pp_size:
        raise ConfigError(f"pipeline_scheduler='1f1b_interleaved' needs several stages per device: set "
                          f"pipeline_nstages to a multiple > 1 of pp_size ({pp_size}), got {nstages}")
    cut_stages(graph, nstages, leads)
    schedule(graph, nmicros, scheduler, pp_size, ngpus // pp_size)


@register_policy("hybrid", keys=COMMON_KEYS, pipelines=True, whole_model=True)
def hybrid(graph, cfg):
    pas, nmicros, scheduler = _common("hybrid", cfg)
    ngpus = cfg.plan_ngpus
    nstages = pas.get("pipeline_nstages", "auto")
    pivots = pas.get("pipeline_pivots")
    if nstages != "auto":
        nstages = _int("pipeline_nstages", nstages)
        if nstages == 1 and pivots:
            raise ConfigError("pas_config['pipeline_nstages'] = 1 turns the pipeline off, so pipeline_pivots must "
                              "not be set; remove it, or set pipeline_nstages > 1 or 'auto'")
        if nstages > 1 and not pivots:
            raise ConfigError(f"pas_config['pipeline_nstages'] = {nstages} needs pipeline_pivots (the module class "
                              f"names where stages may start, e.g. 'Block')")
    leads = pivot_leads(graph, pivots) if pivots else None
    if nstages == "auto":
        if leads is None:
            nstages = 1
        elif "pp_size" in pas:
            nstages = _int("pp_size", pas["pp_size"])
        else:
            most = 1 + sum(1 for lead in leads if lead > 0)  # a pivot starting at op 0 is no cut point
            nstages = max(d for d in range(1, ngpus + 1) if ngpus % d == 0 and d <= most)
    pp_size = _int("pp_size", pas.get("pp_size", nstages))
    if nstages == 1:
        if pp_size != 1:
            raise ConfigError(f"pp_size ({pp_size}) > 1 needs a pipeline: set pipeline_nstages (and pipeline_pivots)")
        _place(graph, ngpus, ngpus)
        return graph
    _pipeline(graph, cfg, nstages, pp_size, nmicros, scheduler, leads)
    _place(graph, ngpus, ngpus // pp_size)
    return graph


@register_policy("pp", keys=COMMON_KEYS, pipelines=True, whole_model=True)
def pp(graph, cfg):
    pas, nmicros, scheduler = _common("pp", cfg)
    ngpus = cfg.plan_ngpus
    pp_size = _int("pp_size", pas.get("pp_size", ngpus))
    if pp_size != ngpus:
        raise ConfigError(f"pas_policy 'pp' puts one pipeline device on each plan device, so pp_size must equal "
                          f"plan_ngpus ({ngpus}), got {pp_size}; use 'hybrid' to mix in tensor parallelism")
    default = 2 * ngpus if scheduler == "1f1b_interleaved" else ngpus
    nstages = _int("pipeline_nstages", pas.get("pipeline_nstages", default))
    pivots = pas.get("pipeline_pivots")
    if nstages == 1:
        if pivots:
            raise ConfigError("pas_config['pipeline_nstages'] = 1 turns the pipeline off, so pipeline_pivots must "
                              "not be set")
        if ngpus == 1:  # with more devices _pipeline refuses it: pp_size is plan_ngpus, tp_size 1
            _place(graph, ngpus, ngpus)
            return graph
    leads = pivot_leads(graph, pivots) if pivots else None
    _pipeline(graph, cfg, nstages, pp_size, nmicros, scheduler, leads)
    _place(graph, ngpus, 1)
    return graph
