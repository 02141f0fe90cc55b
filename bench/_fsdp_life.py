"""bench/fsdp.py part 7 (`--parts life`): the whole life of a `use_zero=3` run against one process
(not part of nnscaler; issue 43 §5).

The parent writes a Hugging Face directory first (transformers' ``save_pretrained`` of a
``LlamaForCausalLM`` with seed-0 random weights, ~99M parameters by default: vocab 32000, hidden
768, MLP 2048, 7 layers, 12 heads, untied head) in a temporary directory. Then, each in fresh
processes with glibc's `_rss.MALLOC_ENV` and max(1, cores // ranks) intra-op threads:

* ``zero3`` (`--life-nproc` ranks, 4): build the model (wrapped to return its loss) under
  ``torch.device("meta")`` and ``parallelize(..., "dp", ComputeConfig(1, n, use_zero=3),
  init_module_params=False)``; ``nnscaler.ckpt.load(hf_dir, pm)``; ``build_optimizer(pm, Adam)``;
  `--life-steps` (3) steps, rank r on rows [r*B, (r+1)*B) of each global batch; ``nnscaler.ckpt.save``
  (sharded) of model and optimizer;
* ``single`` (one process, the same global batches whole): build the model on the CPU (its own
  random initialisation), ``load_state_dict`` of the directory's tensors (``safetensors.torch.load_file``),
  ``torch.optim.Adam``, the same steps, ``safetensors.torch.save_file`` of the model's and the
  optimizer's tensors (zero-copy writes in safetensors 0.8).

Every process first records its baseline as bench/fsdp.py part 2 does (after importing torch,
transformers' Llama, nnscaler and safetensors, gloo init, one Adam step of a tiny Llama and one of
each collective, released). Each phase (build, load, optimizer, every step, save) runs alone
between barriers: `_rss.release()`, the peak reset (VmHWM := VmRSS), the phase, its peak
(max(VmHWM, a 2 ms sampler)). A process's *life peak* is the largest phase peak; the figure is the
worst rank's life peak above its baseline against the single process's:
**target <= 0.35** (4 ranks: a quarter of the state plus what is gathered and the activations).
The losses of the two must agree (fp32: within `--loss-rtol`).
"""
from __future__ import annotations

import glob
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
import time
from typing import Callable, Dict, List

import _common
import _rss
import torch
import torch.distributed as dist

TARGET = 0.35
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")


def add_args(p) -> None:
    p.add_argument("--life-nproc", type=int, default=4, help="part 7: ranks of the use_zero=3 run")
    p.add_argument("--life-vocab", type=int, default=32000)
    p.add_argument("--life-hidden", type=int, default=768)
    p.add_argument("--life-mlp", type=int, default=2048)
    p.add_argument("--life-layers", type=int, default=7)
    p.add_argument("--life-heads", type=int, default=12)
    p.add_argument("--life-seq", type=int, default=256)
    p.add_argument("--life-batch", type=int, default=1, help="part 7: sequences per rank (the single process: all)")
    p.add_argument("--life-steps", type=int, default=3)


SMOKE = {"life_nproc": 2, "life_vocab": 256, "life_hidden": 64, "life_mlp": 128, "life_layers": 2, "life_heads": 2,
         "life_seq": 16, "life_steps": 1}


def config(args) -> dict:
    return {k: getattr(args, "life_" + k) for k in ("nproc", "vocab", "hidden", "mlp", "layers", "heads", "seq",
                                                    "batch", "steps")} | {"lr": args.lr}


def _llama_config(c: dict):
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=c["vocab"], hidden_size=c["hidden"], intermediate_size=c["mlp"],
                       num_hidden_layers=c["layers"], num_attention_heads=c["heads"], num_key_value_heads=c["heads"],
                       max_position_embeddings=c["seq"], tie_word_embeddings=False, attention_dropout=0.0,
                       attn_implementation="sdpa", use_cache=False)


def _model(c: dict):
    from _causal_lm import CausalLMLoss
    from transformers import LlamaForCausalLM
    return CausalLMLoss(LlamaForCausalLM(_llama_config(c)))


def write_hf_directory(c: dict, path: str) -> int:
    """``save_pretrained`` of the seed-0 Llama into `path`; its parameter count."""
    torch.manual_seed(0)
    model = _model(c).model
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def _batch(c: dict, step: int, rows: slice) -> dict:
    world_rows = c["batch"] * c["nproc"]
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, c["vocab"], (world_rows, c["seq"] + 1), generator=g)
    return {"input_ids": ids[rows, :-1].contiguous(), "labels": ids[rows, 1:].contiguous()}


def _tiny_step() -> None:
    """One Adam step of a tiny Llama: the baseline's warm-up (transformers' code, thread pools)."""
    torch.manual_seed(1)
    c = {"vocab": 256, "hidden": 64, "mlp": 128, "layers": 2, "heads": 2, "seq": 16}
    m = _model(c)
    o = torch.optim.Adam(m.parameters(), lr=1e-3)
    m(**{"input_ids": torch.zeros(2, 16, dtype=torch.long), "labels": torch.zeros(2, 16, dtype=torch.long)}).backward()
    o.step()


def _phase(name: str, fn: Callable, out: Dict[str, dict]):
    """Run `fn()` alone between barriers; record its RSS at the start, its peak and its seconds."""
    dist.barrier()
    _rss.release()
    start = _rss.reset_peak()
    sampler = _rss.Sampler()
    t = time.perf_counter()
    result = fn()
    seconds = time.perf_counter() - t
    peak = max(_rss.status("VmHWM"), sampler.stop())
    dist.barrier()
    out[name] = {"start": start, "peak": peak, "end": _rss.status("VmRSS"), "s": seconds}
    return result


def _imports() -> None:
    import nnscaler.ckpt  # noqa: F401
    import safetensors.torch  # noqa: F401
    from nnscaler import ComputeConfig, build_optimizer, parallelize  # noqa: F401
    from transformers import LlamaForCausalLM  # noqa: F401


def _result(rank: int, baseline: tuple, phases: Dict[str, dict], losses: List[float], n_params: int) -> dict:
    peak = max(p["peak"] for p in phases.values())
    return {"rank": rank, "params": n_params, "baseline_cold_rss": baseline[0], "baseline_rss": baseline[1],
            "phases": phases, "life_peak": peak, "life_peak_above_baseline": peak - baseline[1],
            "peak_phase": max(phases, key=lambda k: phases[k]["peak"]), "losses": losses}


def zero3_case(rank: int, c: dict, hf_dir: str, gen_dir: str, out_dir: str) -> dict:
    from nnscaler import ComputeConfig, build_optimizer, parallelize
    import nnscaler.ckpt as ckpt
    _imports()
    world = dist.get_world_size()
    baseline = _rss.baselines(_tiny_step, COLLECTIVES)
    rows = slice(rank * c["batch"], (rank + 1) * c["batch"])
    batches = [_batch(c, s, rows) for s in range(c["steps"])]
    phases: Dict[str, dict] = {}

    def build():
        with torch.device("meta"):
            model = _model(c)
        return parallelize(model, batches[0], "dp", ComputeConfig(1, world, use_zero=3), gen_savedir=gen_dir,
                           instance_name="life", reuse="override", init_module_params=False)
    pm = _phase("build", build, phases)
    _phase("load", lambda: ckpt.load(hf_dir, pm), phases)
    opt = _phase("optimizer", lambda: build_optimizer(pm, torch.optim.Adam, lr=c["lr"]), phases)
    losses = [_phase(f"step {s}", lambda: _common.timed_step(pm, opt, batches[s]).item(), phases)
              for s in range(c["steps"])]
    _phase("save", lambda: ckpt.save(os.path.join(out_dir, "zero3"), pm, opt), phases)
    losses = [x / world for x in _common.all_reduce_floats(losses)]
    return _result(rank, baseline, phases, losses, None)


def single_case(rank: int, c: dict, hf_dir: str, out_dir: str) -> dict:
    from safetensors.torch import load_file, save_file
    _imports()
    baseline = _rss.baselines(_tiny_step, COLLECTIVES)
    batches = [_batch(c, s, slice(None)) for s in range(c["steps"])]
    phases: Dict[str, dict] = {}

    def build():
        torch.manual_seed(0)
        return _model(c)
    model = _phase("build", build, phases)

    def load():
        state = {}
        for f in sorted(glob.glob(os.path.join(hf_dir, "*.safetensors"))):
            state.update(load_file(f))
        model.model.load_state_dict(state)
    _phase("load", load, phases)
    opt = _phase("optimizer", lambda: torch.optim.Adam(model.parameters(), lr=c["lr"]), phases)
    losses = [_phase(f"step {s}", lambda: _common.timed_step(model, opt, batches[s]).item(), phases)
              for s in range(c["steps"])]

    def save():
        os.makedirs(os.path.join(out_dir, "single"), exist_ok=True)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()},
                  os.path.join(out_dir, "single", "model.safetensors"))
        save_file({f"{i}.{k}": v for i, st in enumerate(opt.state.values()) for k, v in st.items()},
                  os.path.join(out_dir, "single", "optimizer.safetensors"))
    _phase("save", save, phases)
    return _result(rank, baseline, phases, losses, sum(p.numel() for p in model.parameters()))


def summary(zero3: list, single: dict, spawn_s: Dict[str, float], n_params: int, loss_rtol: float) -> dict:
    """The worst rank's life peak above its baseline against the single process's, per phase too."""
    worst = max(zero3, key=lambda r: r["life_peak_above_baseline"])
    ratio = worst["life_peak_above_baseline"] / single["life_peak_above_baseline"]
    phases = {}
    for name in single["phases"]:
        z = max(r["phases"][name]["peak"] - r["baseline_rss"] for r in zero3)
        s = single["phases"][name]["peak"] - single["baseline_rss"]
        phases[name] = {"zero3_worst_above_baseline": z, "single_above_baseline": s, "ratio": z / s if s else None,
                        "zero3_s": max(r["phases"][name]["s"] for r in zero3), "single_s": single["phases"][name]["s"]}
    loss_diff = _common.max_rel_diff(zero3[0]["losses"], single["losses"])
    return {"params": n_params, "target": TARGET, "ratio": ratio, "met": ratio <= TARGET,
            "worst_rank": worst["rank"], "worst_peak_phase": worst["peak_phase"],
            "single_peak_phase": single["peak_phase"],
            "zero3_life_peak_above_baseline": worst["life_peak_above_baseline"],
            "single_life_peak_above_baseline": single["life_peak_above_baseline"],
            "phases": phases, "losses": {"zero3": zero3[0]["losses"], "single": single["losses"]},
            "loss_rel_diff": loss_diff, "losses_ok": loss_diff <= loss_rtol, "spawn_s": spawn_s,
            "per_rank": zero3, "single": single}


def report(s: dict, table, fmt_mib) -> str:
    rows = [[name, fmt_mib(x["zero3_worst_above_baseline"]), fmt_mib(x["single_above_baseline"]),
             "-" if x["ratio"] is None else f"{x['ratio']:.3f}", f"{x['zero3_s']:.1f}", f"{x['single_s']:.1f}"]
            for name, x in s["phases"].items()]
    rows.append(["life (largest phase)", fmt_mib(s["zero3_life_peak_above_baseline"]),
                 fmt_mib(s["single_life_peak_above_baseline"]), f"{s['ratio']:.3f}", "", ""])
    return table(["phase", "use_zero=3 worst rank: peak above baseline MiB", "one process", "ratio",
                  "use_zero=3 s", "one process s"], rows)
