"""``nnscaler plan estimate``: plan a described cluster (a command of the ``plan`` plug-in).

    nnscaler plan estimate --model-config CONFIG.json --cluster CLUSTER.yaml --gpus N \
        --seq-len S --global-batch-tokens T [--json] [--save PLAN.json] [--top K] \
        [--ep E] [--moe-imbalance F] [--cp C] [--fix FIELD=VALUE ...] [--calibrate-step-seconds X]

prints the chosen plan (tp, cp for long sequences, pp, dp, ep for mixture-of-experts models, zero
0/1/3, micro-batch, recompute), its predicted step time, tokens/s, TFLOP/s per GPU, MFU and peak
memory per GPU, then the best plan of each other (tp, cp, pp) family with the reason it lost.
``--json``: one JSON object instead. ``--fix`` pins plan fields; ``--calibrate-step-seconds``
prints the compute efficiencies that reproduce a measured step of the plan (`calibrate`). Exit
code 1 with a one-line error on a bad config, cluster, workload or option.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.table import Table

from nnscaler.ir import ConfigError

from .calibrate import calibrate
from .local import resolve_cluster
from .model import ModelSpec
from .plan_cost import MOE_IMBALANCE, Workload, zero_label
from .report import result_json, save_estimate
from .search import search

__all__ = ["FIX_FIELDS", "estimate", "parse_fix"]

FIX_FIELDS = ("tp", "cp", "pp", "dp", "ep", "zero", "micro_batch", "recompute", "virtual")
_BOOLS = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}

_err = Console(stderr=True)
PIPED_WIDTH = 400  # columns the output gets when it is not a terminal


def estimate(model_config: Path = typer.Option(..., "--model-config", help="A Hugging Face config.json (any "
                                                "AutoModelForCausalLM type), or its folder."),
             cluster: str = typer.Option(..., "--cluster", help="A cluster YAML, a shipped name (a100-80gb-sxm, "
                                         "h100-sxm, h200) or 'local' (this machine, measured)."),
             gpus: int = typer.Option(..., "--gpus", min=1, help="GPUs to plan for (whole nodes)."),
             seq_len: int = typer.Option(..., "--seq-len", min=1, help="Tokens per sequence."),
             global_batch_tokens: int = typer.Option(..., "--global-batch-tokens", min=1,
                                                     help="Tokens per optimizer step over all GPUs."),
             as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
             save: Optional[Path] = typer.Option(None, "--save", help="Write the plan (JSON, with the Trainer "
                                                 "configuration that runs it) to this file."),
             top: int = typer.Option(8, "--top", min=0, help="Other plan families to list."),
             ep: Optional[int] = typer.Option(None, "--ep", help="Mixture of experts: force this expert-parallel "
                                              "degree (default: searched)."),
             moe_imbalance: float = typer.Option(MOE_IMBALANCE, "--moe-imbalance", help="Mixture of experts: the "
                                                 "busiest rank's expert compute over the mean (1 = perfect "
                                                 "balance)."),
             cp: Optional[int] = typer.Option(None, "--cp", help="Long context: force this context-parallel "
                                              "degree (default: searched for sequences over 8192 tokens)."),
             fix: List[str] = typer.Option([], "--fix", help="Pin a plan field, FIELD=VALUE (repeatable): "
                                           + ", ".join(FIX_FIELDS) + "; e.g. --fix tp=8 --fix pp=16."),
             calibrate_step_seconds: Optional[float] = typer.Option(
                 None, "--calibrate-step-seconds", help="A measured step of the chosen plan, in seconds: print the "
                 "matmul and attention efficiencies that reproduce it (pin the measured plan with --fix).")) -> None:
    """Plan a cluster you do not have: predicted step time, memory and MFU of the best plan."""
    try:
        fixed = parse_fix(fix, ep=ep, cp=cp)
        spec = ModelSpec.from_hf_config(model_config)
        described = resolve_cluster(cluster, gpus)
        work = Workload(gpus, seq_len, global_batch_tokens, moe_imbalance)
        result = search(spec, described, work, top=top, fixed=fixed or None)
        data = result_json(result, spec, described, work)
        if calibrate_step_seconds is not None:
            data["calibration"] = calibrate(spec, described, work, result.best.plan, calibrate_step_seconds)
        if save is not None:
            save_estimate(save, data)
    except ConfigError as e:
        _err.print(f"[red]Error:[/red] {e}", markup=True, highlight=False, soft_wrap=True)
        raise typer.Exit(1)
    if as_json:
        typer.echo(json.dumps(data))
        return
    _print(data, save)


def parse_fix(items: List[str], ep: Optional[int] = None, cp: Optional[int] = None) -> dict:
    """``["tp=8", "recompute=yes"]`` (and ``--ep`` / ``--cp``) as `search`'s `fixed` mapping."""
    fixed: dict = {}
    for item in items:
        field, sep, raw = item.partition("=")
        field, raw = field.strip(), raw.strip().lower()
        if not sep or field not in FIX_FIELDS:
            raise ConfigError(f"--fix {item!r}: give FIELD=VALUE with FIELD one of {', '.join(FIX_FIELDS)} "
                              f"(e.g. --fix tp=8)")
        if field == "recompute":
            if raw not in _BOOLS:
                raise ConfigError(f"--fix {item!r}: recompute is yes or no")
            value = _BOOLS[raw]
        elif raw.isdigit() and int(raw) >= (0 if field == "zero" else 1):
            value = int(raw)
        else:
            raise ConfigError(f"--fix {item!r}: {field} must be a whole number >= {0 if field == 'zero' else 1}")
        if fixed.get(field, value) != value:
            raise ConfigError(f"--fix gives {field} twice ({fixed[field]} and {value}); keep one")
        fixed[field] = value
    for name, value in (("ep", ep), ("cp", cp)):
        if value is not None:
            if fixed.get(name, value) != value:
                raise ConfigError(f"--{name} {value} and --fix {name}={fixed[name]} disagree; keep one")
            fixed[name] = value
    return fixed


def _gb(x) -> str:
    return f"{x:.1f}" if x >= 1 else f"{x:.3g}"


def _s(x) -> str:
    return f"{x:.3f} s" if x >= 1 else f"{x * 1e3:.3g} ms"


def _tflops(x) -> str:
    return f"{x:.1f} TFLOP/s" if x >= 1 else f"{x * 1e3:.3g} GFLOP/s"


def _params(n) -> str:
    return f"{n / 1e9:,.1f} B" if n >= 1e9 else f"{n / 1e6:,.2f} M"


def _plan_name(r: dict) -> str:
    return (f"tp{r['tp']}" + (f" cp{r['cp']}" if r.get("cp", 1) > 1 else "") + f" pp{r['pp']} dp{r['dp']}"
            + (f" ep{r['ep']}" if r.get("ep", 1) > 1 else "")
            + (f" v{r['virtual_stages']}" if r["virtual_stages"] > 1 else "")
            + zero_label(r["zero"], r.get("zero_ngroups", 1)) + f" mb{r['micro_batch']}"
            + (" rc" if r["recompute"] else ""))


def _console() -> Console:
    """Lines are not broken by the console (the terminal wraps them); piped, a width no table needs to wrap
    in, so a phrase such as ``memory 71.7 GB per GPU`` stays on one line for the reader or grep."""
    console = Console(soft_wrap=True)
    return console if console.is_terminal else Console(soft_wrap=True, width=PIPED_WIDTH)


def _print(d: dict, save) -> None:
    console = _console()
    m, c, moe = d["model"], d["cluster"], d.get("moe")
    active = f", {_params(moe['active_params'])} active" if moe else ""
    console.print(f"[bold]{m['name']}[/bold] ({_params(m['params'])} parameters{active}) on {d['gpus']} x "
                  f"{c['gpu']['name']} ({c['name']}), seq {d['seq_len']}, {d['global_batch_tokens']:,} tokens a step",
                  highlight=False)
    zero = f"{d['zero']}" + (f" in {d['zero_ngroups']} groups" if d.get("zero_ngroups", 1) > 1 else "")
    long = d["cp"] > 1 or any(r["cp"] > 1 for r in d["runners_up"])  # show cp
    console.print(f"  plan: tp {d['tp']}, " + (f"cp {d['cp']}, " if long else "") + f"pp {d['pp']}, dp {d['dp']}, "
                  + (f"ep {d['ep']}, " if moe else "")
                  + f"zero {zero}, micro-batch "
                  f"{d['micro_batch']} x {d['nmicros']}, recompute {'yes' if d['recompute'] else 'no'}"
                  + (f", interleaved {d['virtual_stages']} stages per GPU" if d["virtual_stages"] > 1 else ""),
                  highlight=False)
    console.print(f"  step {_s(d['step_s'])}, {d['tokens_per_s']:,.0f} tokens/s, {_tflops(d['tflops_per_gpu'])} "
                  f"per GPU, MFU {d['mfu']:.1%}, memory {_gb(d['memory_gb'])} GB per GPU", highlight=False)
    if moe:
        console.print(f"  mixture of experts: {moe['experts']} experts, top {moe['top_k']}, expert ffn "
                      f"{moe['expert_ffn']}" + (f", shared ffn {moe['shared_ffn']}" if moe["shared_ffn"] else "")
                      + f", {moe['moe_layers']} of {m['layers']} layers; {_params(moe['active_params'])} of "
                      f"{_params(moe['total_params'])} parameters active; expert load imbalance "
                      f"{moe['imbalance']:g} assumed (the busiest rank's expert compute)", highlight=False)
    b = {k: v for k, v in d["breakdown_s"].items() if (moe or k != "ep_comm") and (long or k != "cp_comm")}
    console.print("  step parts: " + ", ".join(f"{k} {_s(v)}" for k, v in b.items()), highlight=False)
    console.print(f"  searched {d['plans_evaluated']} plans in {d['search_s']:.2f} s", highlight=False)
    if d["runners_up"]:
        table = Table("plan", *(["cp"] if long else []), "zero", *(["ep"] if moe else []), "step", "MFU",
                      "memory GB", "lost on")
        for col in range(1, len(table.columns) - 1):
            table.columns[col].justify = "right"
        for r in d["runners_up"]:
            table.add_row(_plan_name(r), *([str(r["cp"])] if long else []), str(r["zero"]),
                          *([str(r["ep"])] if moe else []), _s(r["step_s"]),
                          f"{r['mfu']:.1%}", _gb(r["memory_gb"]), r["reason"])
        console.print(table)
    t = d["trainer"]
    console.print(f"  run it: pas_policy {t['pas_policy']!r}, compute_config {json.dumps(t['compute_config'])}, "
                  f"micro_batch_size {t['micro_batch_size']}, grad_accumulation_steps {t['grad_accumulation_steps']}"
                  + (f" (saved to {save})" if save else ""), highlight=False, soft_wrap=True)
    if d.get("trainer_note"):
        console.print(f"  note: {d['trainer_note']}", highlight=False, soft_wrap=True)
    cal = d.get("calibration")
    if cal:
        console.print(f"  calibration: the measured {_s(cal['measured_step_s'])} step (estimated "
                      f"{_s(cal['estimated_step_s'])}) is reproduced at {cal['factor']:.3g} x this cluster's matmul "
                      f"and attention efficiency; put in the cluster YAML: {cal['yaml']}", highlight=False,
                      soft_wrap=True)
